/* exec_search.h: os.execvpe's search for a command, shared by dsec-confine (confine.c) and
 * chronus._spawn (spawn.c). A name with a slash is executed as it is; otherwise each directory
 * of `path` (NULL: Python's os.defpath, "/bin:/usr/bin"; an empty entry is the cwd) is tried in
 * turn: a candidate failing with ENOENT/ENOTDIR is skipped, the first other error is the one
 * reported, else the last. Only execve and string functions: safe in a vfork-style child.
 * Returns only on failure, with the errno to report. */
#ifndef DSEC_EXEC_SEARCH_H
#define DSEC_EXEC_SEARCH_H

#include <errno.h>
#include <string.h>
#include <unistd.h>

static int exec_search(const char *prog, char *const argv[], char *const envp[], const char *path) {
    if (prog[0] == '\0') return ENOENT;
    if (strchr(prog, '/')) {
        execve(prog, argv, envp);
        return errno;
    }
    if (path == NULL) path = "/bin:/usr/bin";
    int saved = 0, last = ENOENT;
    size_t plen = strlen(prog);
    for (const char *p = path;; p++) {
        const char *end = strchrnul(p, ':');
        size_t dlen = (size_t)(end - p);
        char candidate[4096];
        if (dlen + plen + 2 > sizeof candidate) {
            last = ENAMETOOLONG;
        } else {
            if (dlen == 0) {
                candidate[0] = '.';
                dlen = 1;
            } else {
                memcpy(candidate, p, dlen);
            }
            candidate[dlen] = '/';
            memcpy(candidate + dlen + 1, prog, plen + 1);
            execve(candidate, argv, envp);
            last = errno;
        }
        if (last != ENOENT && last != ENOTDIR && saved == 0) saved = last;
        if (*end == '\0') break;
        p = end;
    }
    return saved ? saved : last;
}

#endif
