/* dsec-sudo: `sudo` in a dsec sandbox, a client of chronus's sudo service (chronus/sudo.py).
 *
 * Why not the real sudo: chronus starts every command with no_new_privs (Landlock and the
 * per-command seccomp filter need it without CAP_SYS_ADMIN), and no_new_privs makes a setuid
 * program run with its caller's privileges, so sudo cannot become root. Instead, when the
 * sandbox's spec lists sudo users (SandboxSpec.sudo_users), chronus listens on SOCKET_PATH;
 * this program hands it the request and its own stdin, stdout and stderr (SCM_RIGHTS), and
 * chronus, which is root and outside every command's domain, starts the command as the target
 * user in a domain of its own, confined exactly as a command chronus runs for the API. Who asks
 * is the kernel's answer (SO_PEERCRED), never anything this program says.
 *
 * The container runtime shows this program at /usr/bin/sudo when the image has a sudo there
 * (which could not work); it is always at /.dsec/bin/dsec-sudo. Without sudo users, it says
 * that sudo is not enabled.
 *
 * Options, as sudo's: -u USER, -i (login shell), -s (shell), -E and --preserve-env[=LIST],
 * -D DIR, -l (what may be run), -V, -h, --, and VAR=value words before the command; -H, -n,
 * -S, -k change nothing (no password is ever asked); -k, -K and -v alone succeed. Others (-g,
 * -b, -e, -C, -r, -t, -T, -U, -A, -p, -P) and sudoedit are refused, naming it: exit 1.
 *
 * Request (one message): a 4-byte little-endian body length carrying SCM_RIGHTS 0, 1, 2, then
 * the body: NUL-terminated fields
 *   "dsec-sudo/1" USER MODE PRESERVE CWD CHDIR NARGV ARGV... NSET SET... NENV ENV...
 * MODE is a set of letters: i (login), s (shell), E (preserve the whole environment).
 * Then: each byte this program sends is a signal number to relay to the command (INT, TERM,
 * HUP, QUIT, USR1, USR2, as sudo relays them); chronus answers one line "X CODE SIGNAL\n"
 * when the command ends, and ends the command if this program goes away first.
 * Exit status: the command's; a command killed by a signal kills this program with it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define SOCKET_PATH "/dev/dsec-sudo"
#define MAX_BODY (4u << 20)

extern char **environ;
static int sock = -1;
static const int relayed[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

static void die(const char *msg, const char *arg) {
    fprintf(stderr, "sudo: %s%s\n", msg, arg ? arg : "");
    exit(1);
}

static void usage(FILE *to, int status) {
    fputs("usage: sudo [-nEHiksSKlVhv] [-u user] [-D directory] [--preserve-env[=list]]\n"
          "            [VAR=value] [-i | -s] [command [arg ...]]\n"
          "dsec-sudo: runs the command through the sandbox's chronus (SandboxSpec.sudo_users)\n",
          to);
    exit(status);
}

static void relay(int sig) {
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    ssize_t w = send(sock, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w;
    errno = saved;
}

/* A growable body of NUL-terminated fields. */
static char *body;
static size_t blen, bcap;

static void put(const char *s) {
    size_t n = strlen(s) + 1;
    if (blen + n > MAX_BODY) die("the command and its environment are too long", NULL);
    if (blen + n > bcap) {
        bcap = (blen + n) * 2;
        body = realloc(body, bcap);
        if (body == NULL) die("out of memory", NULL);
    }
    memcpy(body + blen, s, n);
    blen += n;
}

static void put_count(long n) {
    char buf[32];
    snprintf(buf, sizeof buf, "%ld", n);
    put(buf);
}

static int takes_value(const char *opt, const char *name, char **argv, int *i, const char **out) {
    /* "-uUSER", "-u USER", "--user=USER", "--user USER" */
    size_t n = strlen(name);
    if (strncmp(opt, name, n) != 0) return 0;
    if (opt[n] == '=' && name[1] == '-') {
        *out = opt + n + 1;
        return 1;
    }
    if (opt[n] != '\0') return 0;
    if (argv[*i + 1] == NULL) {
        fprintf(stderr, "sudo: option '%s' requires an argument\n", name);
        usage(stderr, 1);
    }
    *out = argv[++*i];
    return 1;
}

int main(int argc, char **argv) {
    const char *user = "root", *preserve = "", *chdir_to = "";
    char mode[4] = "";
    int list = 0, reset = 0, i = 1;
    (void)argc;
    const char *self = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    if (strcmp(self, "sudoedit") == 0) die("sudoedit is not supported in a dsec sandbox", NULL);
    for (; argv[i] != NULL && argv[i][0] == '-' && argv[i][1] != '\0'; i++) {
        const char *a = argv[i], *v;
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (a[1] == '-') {
            if (takes_value(a, "--user", argv, &i, &v)) user = v;
            else if (takes_value(a, "--chdir", argv, &i, &v)) chdir_to = v;
            else if (strcmp(a, "--preserve-env") == 0) strcat(mode, strchr(mode, 'E') ? "" : "E");
            else if (strncmp(a, "--preserve-env=", 15) == 0) preserve = a + 15;
            else if (strcmp(a, "--login") == 0) strcat(mode, strchr(mode, 'i') ? "" : "i");
            else if (strcmp(a, "--shell") == 0) strcat(mode, strchr(mode, 's') ? "" : "s");
            else if (strcmp(a, "--non-interactive") == 0 || strcmp(a, "--set-home") == 0 ||
                     strcmp(a, "--stdin") == 0) continue;
            else if (strcmp(a, "--reset-timestamp") == 0) reset = 1;
            else if (strcmp(a, "--help") == 0) usage(stdout, 0);
            else if (strcmp(a, "--version") == 0) {
                puts("Sudo version 1.9 (dsec-sudo: the sandbox's chronus runs the command)");
                return 0;
            } else if (strcmp(a, "--list") == 0) list = 1;
            else if (strcmp(a, "--validate") == 0 || strcmp(a, "--remove-timestamp") == 0) return 0;
            else {
                fprintf(stderr, "sudo: option '%s' is not supported in a dsec sandbox\n", a);
                usage(stderr, 1);
            }
            continue;
        }
        for (const char *c = a + 1; *c; c++) {
            switch (*c) {
            case 'u':
            case 'D':
                if (c[1] != '\0') v = c + 1;
                else if (argv[i + 1] != NULL) v = argv[++i];
                else {
                    fprintf(stderr, "sudo: option requires an argument -- '%c'\n", *c);
                    usage(stderr, 1);
                }
                if (*c == 'u') user = v;
                else chdir_to = v;
                goto next_word; /* the rest of this word was the value */
            case 'i':
            case 's':
            case 'E':
                if (!strchr(mode, *c)) strncat(mode, c, 1);
                break;
            case 'n':
            case 'H':
            case 'S':
                break; /* no password is ever asked */
            case 'k':
                reset = 1; /* alone: forget cached credentials, of which there are none */
                break;
            case 'K':
            case 'v':
                return 0;
            case 'l':
                list = 1;
                break;
            case 'V':
                puts("Sudo version 1.9 (dsec-sudo: the sandbox's chronus runs the command)");
                return 0;
            case 'h':
                usage(stdout, 0);
                break;
            default:
                fprintf(stderr, "sudo: option '-%c' is not supported in a dsec sandbox\n", *c);
                usage(stderr, 1);
            }
        }
    next_word:;
    }
    if (strchr(mode, 'i') && strchr(mode, 's'))
        die("you may not specify both the -i and -s options", NULL);
    char **command = argv + i;
    long nset = 0;
    while (command[nset] != NULL && strchr(command[nset], '=') != NULL &&
           command[nset][0] != '=' && command[nset][0] != '/')
        nset++;
    char **args = command + nset;
    if (list) {
        puts("User may run the following commands in this sandbox:\n    (ALL : ALL) NOPASSWD: ALL");
        return 0;
    }
    if (args[0] == NULL && !strchr(mode, 'i') && !strchr(mode, 's')) {
        if (reset) return 0;
        usage(stderr, 1);
    }

    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof cwd) == NULL) cwd[0] = '\0';
    put("dsec-sudo/1");
    put(user);
    put(mode);
    put(preserve);
    put(cwd);
    put(chdir_to);
    long nargs = 0;
    while (args[nargs] != NULL) nargs++;
    put_count(nargs);
    for (long k = 0; k < nargs; k++) put(args[k]);
    put_count(nset);
    for (long k = 0; k < nset; k++) put(command[k]);
    long nenv = 0;
    while (environ[nenv] != NULL) nenv++;
    put_count(nenv);
    for (long k = 0; k < nenv; k++) put(environ[k]);

    sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0) die("socket: ", strerror(errno));
    struct sockaddr_un addr = {.sun_family = AF_UNIX, .sun_path = SOCKET_PATH};
    if (connect(sock, (struct sockaddr *)&addr, sizeof addr) != 0) {
        if (errno == ENOENT || errno == ECONNREFUSED)
            die("sudo is not enabled in this sandbox (its spec lists no sudo_users)", NULL);
        die("cannot reach the sandbox's sudo service: ", strerror(errno));
    }
    unsigned char head[4] = {blen & 0xff, (blen >> 8) & 0xff, (blen >> 16) & 0xff, blen >> 24};
    int fds[3] = {0, 1, 2};
    char control[CMSG_SPACE(sizeof fds)];
    memset(control, 0, sizeof control);
    struct iovec iov = {head, sizeof head};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(cm), fds, sizeof fds);
    if (sendmsg(sock, &msg, MSG_NOSIGNAL) != (ssize_t)sizeof head)
        die("cannot reach the sandbox's sudo service: ", strerror(errno));
    for (size_t off = 0; off < blen;) {
        ssize_t w = send(sock, body + off, blen - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) die("cannot reach the sandbox's sudo service: ", strerror(errno));
        off += (size_t)w;
    }

    struct sigaction sa = {.sa_handler = relay};
    sigemptyset(&sa.sa_mask);
    for (size_t k = 0; k < sizeof relayed / sizeof relayed[0]; k++) sigaction(relayed[k], &sa, NULL);

    char reply[64];
    size_t got = 0;
    while (got < sizeof reply - 1) {
        ssize_t r = read(sock, reply + got, sizeof reply - 1 - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
        if (memchr(reply, '\n', got)) break;
    }
    reply[got] = '\0';
    int code, sig;
    if (sscanf(reply, "X %d %d", &code, &sig) != 2)
        die("the sandbox's sudo service went away before the command ended", NULL);
    if (sig > 0) {
        signal(sig, SIG_DFL);
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, sig);
        sigprocmask(SIG_UNBLOCK, &set, NULL);
        kill(getpid(), sig);
        return 128 + sig;
    }
    return code;
}
