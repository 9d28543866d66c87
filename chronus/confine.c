/* dsec-confine: the trampoline every sandbox command is started through (chronus/proc.py).
 *
 *   dsec-confine ERRFD RULESETFD FILTERFD CWD CRED NENV ENV... PROGRAM [ARG...]
 *
 * chronus starts it with posix_spawn (vfork: no copy of chronus's page tables, no copy-on-write
 * faults in chronus afterwards) and an EMPTY environment: the command's NENV variables come as
 * arguments, so nothing the caller chose (GLIBC_TUNABLES, ...) is parsed by this still
 * unconfined process's libc start-up. It then does what a forked child of chronus did: with a
 * ruleset or filter, no_new_privs; enter a new Landlock domain made from RULESETFD (-1: none);
 * with CRED "UID:GID:G1,G2,..." (- : none), setgroups, setresgid and setresuid (ExecRequest.user);
 * chdir(CWD) (after the domain: a path through /proc/<pid>/... of a process outside it must not
 * resolve); install the seccomp program read from FILTERFD (-1: none); close those descriptors;
 * exec PROGRAM with the given environment and os.execvpe's search (the PATH of that environment;
 * a candidate failing with ENOENT/ENOTDIR is skipped, the first other error is reported, else
 * the last one).
 * The command is thereby in a domain of its own, nested in nothing of chronus's: it can signal
 * no thread of chronus (Landlock checks a signal against the target thread's domain).
 *
 * A failure is written to ERRFD as "step\0errno\0detail" and the process exits 127; ERRFD is
 * close-on-exec, so chronus reads EOF when the exec succeeded. Built statically by the toolkit
 * (edge/toolkit.py): no loader runs, so no LD_* variable or /etc/ld.so.preload of the image is
 * honoured before the command is confined.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "exec_search.h"

#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif

static int errfd = -1;

static void fail(const char *step, int err, const char *detail) {
    if (errfd >= 0) {
        char buf[4096];
        int n = snprintf(buf, sizeof buf, "%s%c%d%c%s", step, 0, err, 0, detail);
        if (n > 0) {
            ssize_t w = write(errfd, buf, n < (int)sizeof buf ? (size_t)n : sizeof buf - 1);
            (void)w;
        }
    }
    _exit(127);
}

int main(int argc, char **argv) {
    if (argc >= 2) errfd = atoi(argv[1]);
    if (argc < 8) fail("setup", EINVAL, "usage: dsec-confine ERRFD RULESETFD FILTERFD CWD CRED NENV ENV... PROGRAM...");
    int ruleset = atoi(argv[2]), filter = atoi(argv[3]);
    const char *cwd = argv[4];
    const char *cred = argv[5];
    long nenv = strtol(argv[6], NULL, 10);
    if (nenv < 0 || nenv > argc - 8) fail("setup", EINVAL, "NENV");
    char **envp = calloc((size_t)nenv + 1, sizeof *envp);
    if (envp == NULL) fail("setup", ENOMEM, "environment");
    for (long i = 0; i < nenv; i++) envp[i] = argv[7 + i];
    char **args = argv + 7 + nenv;
    char *prog_copy = args[0];

    if (ruleset >= 0 || filter >= 0) {
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail("landlock", errno, "no_new_privs");
    }
    if (ruleset >= 0) {
        if (syscall(SYS_landlock_restrict_self, ruleset, 0) != 0) fail("landlock", errno, "restrict");
        close(ruleset);
    }
    if (strcmp(cred, "-") != 0) {
        char *end;
        unsigned long uid = strtoul(cred, &end, 10);
        if (*end != ':') fail("user", EINVAL, cred);
        unsigned long gid = strtoul(end + 1, &end, 10);
        if (*end != ':') fail("user", EINVAL, cred);
        static gid_t groups[64];
        size_t ngroups = 0;
        for (char *p = end + 1; *p != '\0' && ngroups < 64;) {
            groups[ngroups++] = (gid_t)strtoul(p, &end, 10);
            if (*end != ',' && *end != '\0') fail("user", EINVAL, cred);
            p = *end == ',' ? end + 1 : end;
        }
        if (setgroups(ngroups, groups) != 0) fail("user", errno, "setgroups");
        if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) != 0) fail("user", errno, "setgid");
        if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) != 0) fail("user", errno, "setuid");
    }
    if (chdir(cwd) != 0) fail("chdir", errno, cwd);
    if (filter >= 0) {
        struct stat st;
        if (fstat(filter, &st) != 0) fail("seccomp", errno, "filter");
        if (st.st_size <= 0 || st.st_size % sizeof(struct sock_filter) ||
            st.st_size > 4096 * (off_t)sizeof(struct sock_filter))
            fail("seccomp", EINVAL, "filter");
        static struct sock_filter code[4096];
        if (pread(filter, code, st.st_size, 0) != st.st_size) fail("seccomp", EIO, "filter");
        struct sock_fprog fprog = {(unsigned short)(st.st_size / sizeof(struct sock_filter)), code};
        if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0) != 0)
            fail("seccomp", errno, "filter");
        close(filter);
    }
    if (errfd >= 0 && fcntl(errfd, F_SETFD, FD_CLOEXEC) != 0) fail("setup", errno, "errfd");

    const char *path = NULL;
    for (long i = 0; i < nenv; i++)
        if (strncmp(envp[i], "PATH=", 5) == 0) path = envp[i] + 5;
    fail("exec", exec_search(prog_copy, args, envp, path), prog_copy);
    return 127;
}
