/* chronus._spawn: start a sandbox command confined, in one exec (chronus/proc.py).
 *
 * What dsec-confine (chronus/confine.c) does as a program between chronus and the command,
 * done here in the child of a vfork-style clone (CLONE_VM | CLONE_VFORK: no copy of chronus's
 * page tables, chronus's thread waits until the child has exec'd or failed): the command's
 * only exec is its own. That saves the trampoline's exec and start-up, a third of a
 * `run("true")`'s time in chronus (issue 43, bench/bench_create_profile.py).
 *
 * The child shares chronus's memory, so it runs no code that touches shared state: no malloc,
 * no stdio, no libc wrapper that is not a bare system call. In particular the credential
 * calls are raw system calls: glibc's setresuid/setgroups would, in a process it believes
 * multithreaded, signal every thread of chronus to change theirs (setxid broadcast). Signal
 * handlers are reset to the default before any signal can be delivered (all are blocked
 * across the clone), as posix_spawn does.
 *
 * The child, in order: default dispositions (handlers, and SIGPIPE/SIGXFSZ that Python
 * ignores); a new session; every source descriptor (and the ruleset) copied above 1023
 * first, so that no dup2 clobbers a later source; the controlling terminal (open after
 * setsid), or the stdio descriptors; the extra descriptors; then confine.c's steps:
 * no_new_privs, the Landlock domain, setgroups/setresgid/setresuid, chdir (after the domain),
 * the seccomp filter; the signal mask emptied; exec with os.execvpe's PATH search. A failure
 * is reported as (step, errno, detail) in memory the parent reads once the child has exited
 * (it is reaped here), exactly the SpawnError of the other paths.
 *
 * Built by the toolkit (edge/toolkit.py) against the toolkit's interpreter; without it (no C
 * compiler or no Python headers) chronus uses dsec-confine, or forks.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "exec_search.h"

#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif

#define MAX_FDS 64
#define MAX_GROUPS 64
#define HIGH_FD 1024
#define STACK_BYTES (256 * 1024)

struct kernel_sigaction { /* what rt_sigaction takes (x86-64, arm64) */
    void *handler;
    unsigned long flags;
    void *restorer;
    unsigned long mask;
};

struct job {
    const char *program;
    char *const *argv;
    char *const *envp;
    const char *path; /* PATH of envp, for the search (NULL: none) */
    const char *cwd;
    const char *ctty; /* a tty to make the controlling terminal and stdio, or NULL */
    int nfds;
    int src[MAX_FDS], dst[MAX_FDS];
    int ruleset;
    struct sock_fprog filter; /* len 0: none */
    int creds;
    unsigned int uid, gid;
    int ngroups;
    unsigned int groups[MAX_GROUPS];
    /* the child's report */
    const char *step;
    int err;
    const char *detail;
};

static int fail(struct job *j, const char *step, int err, const char *detail) {
    j->step = step;
    j->err = err;
    j->detail = detail;
    syscall(SYS_exit_group, 127);
    return 127;
}

static int child(void *arg) {
    struct job *j = arg;
    for (int sig = 1; sig < 65; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP) continue;
        struct kernel_sigaction old;
        if (syscall(SYS_rt_sigaction, sig, NULL, &old, 8) != 0) continue;
        int ignored_by_python = sig == SIGPIPE || sig == SIGXFSZ;
        if (old.handler == SIG_DFL || (old.handler == SIG_IGN && !ignored_by_python)) continue;
        struct kernel_sigaction dfl = {SIG_DFL, 0, NULL, 0};
        syscall(SYS_rt_sigaction, sig, &dfl, NULL, 8);
    }
    if (syscall(SYS_setsid) < 0) return fail(j, "setup", errno, "setsid");
    int high[MAX_FDS];
    for (int i = 0; i < j->nfds; i++) {
        high[i] = fcntl(j->src[i], F_DUPFD_CLOEXEC, HIGH_FD);
        if (high[i] < 0) return fail(j, "setup", errno, "dup");
    }
    int ruleset = -1;
    if (j->ruleset >= 0) {
        ruleset = fcntl(j->ruleset, F_DUPFD_CLOEXEC, HIGH_FD);
        if (ruleset < 0) return fail(j, "landlock", errno, "ruleset");
    }
    if (j->ctty != NULL) {
        /* The first tty a session leader opens without O_NOCTTY becomes its terminal. */
        int tty = open(j->ctty, O_RDWR | O_CLOEXEC);
        if (tty < 0) return fail(j, "setup", errno, "tty");
        for (int fd = 0; fd < 3; fd++)
            if (dup2(tty, fd) < 0) return fail(j, "setup", errno, "tty");
    }
    for (int i = 0; i < j->nfds; i++)
        if (dup2(high[i], j->dst[i]) < 0) return fail(j, "setup", errno, "dup2");

    if (ruleset >= 0 || j->filter.len > 0) {
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return fail(j, "landlock", errno, "no_new_privs");
    }
    if (ruleset >= 0 && syscall(SYS_landlock_restrict_self, ruleset, 0) != 0)
        return fail(j, "landlock", errno, "restrict");
    if (j->creds) {
        if (syscall(SYS_setgroups, j->ngroups, j->groups) != 0) return fail(j, "user", errno, "setgroups");
        if (syscall(SYS_setresgid, j->gid, j->gid, j->gid) != 0) return fail(j, "user", errno, "setgid");
        if (syscall(SYS_setresuid, j->uid, j->uid, j->uid) != 0) return fail(j, "user", errno, "setuid");
    }
    if (chdir(j->cwd) != 0) return fail(j, "chdir", errno, j->cwd);
    if (j->filter.len > 0 && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &j->filter, 0, 0) != 0)
        return fail(j, "seccomp", errno, "filter");
    unsigned long none = 0;
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, 8);

    return fail(j, "exec", exec_search(j->program, j->argv, j->envp, j->path), j->program);
}

/* A list of bytes as a NULL-terminated char* array (borrowed pointers into the objects). */
static char **byte_array(PyObject *list, const char *what) {
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of bytes", what);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    char **out = PyMem_Calloc((size_t)n + 1, sizeof *out);
    if (out == NULL) return (char **)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyBytes_Check(item)) {
            PyMem_Free(out);
            PyErr_Format(PyExc_TypeError, "%s must be a list of bytes", what);
            return NULL;
        }
        out[i] = PyBytes_AS_STRING(item);
    }
    return out;
}

/* spawn(program, argv, envp, cwd, fds, ruleset_fd, filter, creds, ctty)
 *   -> (pid, "", 0, "") or (0, step, errno, detail)
 * fds: [(source, target), ...]; filter: the seccomp program's bytes or None;
 * creds: (uid, gid, [gid, ...]) or None; ctty: a tty's path (bytes) or None. */
static PyObject *spawn(PyObject *self, PyObject *args) {
    (void)self;
    const char *program, *cwd;
    PyObject *argv_list, *envp_list, *fds, *filter, *creds, *ctty;
    int ruleset;
    if (!PyArg_ParseTuple(args, "yO!O!yO!iOOO", &program, &PyList_Type, &argv_list, &PyList_Type,
                          &envp_list, &cwd, &PyList_Type, &fds, &ruleset, &filter, &creds, &ctty))
        return NULL;
    struct job j;
    memset(&j, 0, sizeof j);
    j.program = program;
    j.cwd = cwd;
    j.ruleset = ruleset;
    Py_ssize_t nfds = PyList_GET_SIZE(fds);
    if (nfds > MAX_FDS) return PyErr_Format(PyExc_ValueError, "at most %d descriptors", MAX_FDS);
    j.nfds = (int)nfds;
    for (Py_ssize_t i = 0; i < nfds; i++) {
        if (!PyArg_ParseTuple(PyList_GET_ITEM(fds, i), "ii", &j.src[i], &j.dst[i])) return NULL;
    }
    if (filter != Py_None) {
        if (!PyBytes_Check(filter)) return PyErr_Format(PyExc_TypeError, "filter must be bytes");
        Py_ssize_t size = PyBytes_GET_SIZE(filter);
        if (size <= 0 || size % (Py_ssize_t)sizeof(struct sock_filter) ||
            size > 4096 * (Py_ssize_t)sizeof(struct sock_filter))
            return PyErr_Format(PyExc_ValueError, "not a seccomp program");
        j.filter.len = (unsigned short)(size / (Py_ssize_t)sizeof(struct sock_filter));
        j.filter.filter = (struct sock_filter *)PyBytes_AS_STRING(filter);
    }
    if (creds != Py_None) {
        PyObject *groups;
        if (!PyArg_ParseTuple(creds, "IIO!", &j.uid, &j.gid, &PyList_Type, &groups)) return NULL;
        Py_ssize_t ng = PyList_GET_SIZE(groups);
        if (ng > MAX_GROUPS) return PyErr_Format(PyExc_ValueError, "at most %d groups", MAX_GROUPS);
        for (Py_ssize_t i = 0; i < ng; i++) {
            j.groups[i] = (unsigned int)PyLong_AsUnsignedLong(PyList_GET_ITEM(groups, i));
            if (PyErr_Occurred()) return NULL;
        }
        j.ngroups = (int)ng;
        j.creds = 1;
    }
    if (ctty != Py_None) {
        if (!PyBytes_Check(ctty)) return PyErr_Format(PyExc_TypeError, "ctty must be bytes");
        j.ctty = PyBytes_AS_STRING(ctty);
    }
    char **argv = byte_array(argv_list, "argv");
    if (argv == NULL) return NULL;
    char **envp = byte_array(envp_list, "envp");
    if (envp == NULL) {
        PyMem_Free(argv);
        return NULL;
    }
    j.argv = argv;
    j.envp = envp;
    for (char **e = envp; *e != NULL; e++)
        if (strncmp(*e, "PATH=", 5) == 0) j.path = *e + 5;

    void *stack = mmap(NULL, STACK_BYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) {
        PyMem_Free(argv);
        PyMem_Free(envp);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    pid_t pid;
    int clone_errno = 0;
    sigset_t all, old;
    sigfillset(&all);
    Py_BEGIN_ALLOW_THREADS
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid = clone(child, (char *)stack + STACK_BYTES, CLONE_VM | CLONE_VFORK | SIGCHLD, &j);
    if (pid < 0) clone_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid > 0 && j.step != NULL) { /* it failed before its exec: reap it */
        int status;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
    }
    Py_END_ALLOW_THREADS
    munmap(stack, STACK_BYTES);
    PyMem_Free(argv);
    PyMem_Free(envp);
    if (pid < 0) return Py_BuildValue("(isis)", 0, "exec", clone_errno, program);
    if (j.step != NULL) return Py_BuildValue("(isis)", 0, j.step, j.err, j.detail);
    return Py_BuildValue("(isis)", (int)pid, "", 0, "");
}

static PyMethodDef methods[] = {
    {"spawn", spawn, METH_VARARGS, "Start a command confined, in one exec (see chronus/spawn.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "chronus._spawn", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__spawn(void) { return PyModule_Create(&module); }
