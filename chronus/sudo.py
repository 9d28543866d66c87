"""sudo in a sandbox: chronus runs the commands that `dsec-sudo` (chronus/sudo.c) hands it.

Every command chronus starts has no_new_privs set (Landlock and the per-command seccomp filter
need it: the sandbox has no CAP_SYS_ADMIN), and under no_new_privs a setuid program keeps its
caller's privileges, so the image's sudo cannot become root. When the sandbox's spec lists sudo
users (SandboxSpec.sudo_users; DSEC_CHRONUS_SUDO_USERS), chronus listens on SOCKET_PATH, in the
sandbox's /dev (a tmpfs: never in its files, snapshots or packs; only root may replace it):

- who asks is the kernel's answer (SO_PEERCRED at connect), resolved against the sandbox's
  /etc/passwd when the request comes (so an account a command adds later counts): root, or an
  account named in sudo_users, may run anything as anyone (sudoers' `NOPASSWD: ALL`); anybody
  else is refused with sudo's words for it. The sandbox's /etc/sudoers is not consulted.
- the command starts as a command for the API does (`chronus.proc.spawn`): in a fresh Landlock
  domain with the same rules, the same seccomp filter, the target user's uid, gid and groups,
  its own session; on the caller's stdin, stdout and stderr (passed over the socket).
- the environment is sudo's `env_reset` (Debian's defaults): the caller's terminal and locale
  variables, then HOME, SHELL, USER, LOGNAME, MAIL of the target, PATH = secure_path, SUDO_*;
  -E keeps the caller's whole environment (minus the loader's and shells' dangerous
  variables, as sudo drops them), --preserve-env=LIST the named ones, VAR=value words add.
- its lifetime is the connection's: signals dsec-sudo receives are relayed (one byte each),
  the exit status goes back as "X CODE SIGNAL\\n", and if dsec-sudo goes away (killed with its
  command's caller), the command's whole session is killed.

One thread per connection, bounded by MAX_CONNECTIONS: sudo commands are few.
"""

from __future__ import annotations

import _socket
import errno
import os
import struct

from chronus import threads
from chronus.errors import ChronusError
from chronus.proc import SpawnError, decode_status, spawn
from chronus.users import User, resolve_user
from insandbox import poller
from insandbox.log import get_logger
from insandbox.proc import kill_session

TYPE_CHECKING = False
if TYPE_CHECKING:
    from chronus.landlock import Sandboxing

log = get_logger("chronus.sudo")

SOCKET_PATH = "/dev/dsec-sudo"
VERSION = "dsec-sudo/1"
MAX_BODY = 4 << 20  # dsec-sudo's own limit
MAX_CONNECTIONS = 64
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The caller's variables sudo keeps after env_reset (its built-in env_keep list, in short).
KEEP = (
    "COLORS", "COLORTERM", "DISPLAY", "HOSTNAME", "LANG", "LANGUAGE", "LINGUAS", "LS_COLORS",
    "PS1", "PS2", "TERM", "TZ", "XAUTHORITY", "XAUTHORIZATION",
)  # fmt: skip
#: Never passed, not even with -E (sudo's env_delete, in short): they change what a program
#: loads or runs before it reads its own arguments.
DROP_PREFIXES = ("LD_", "BASH_FUNC_", "GCONV_", "GLIBC_", "MALLOC_", "PYTHON", "PERL5", "RUBY")
DROP = ("BASH_ENV", "ENV", "IFS", "CDPATH", "SHELLOPTS", "PS4", "HOSTALIASES", "LOCALDOMAIN",
        "RES_OPTIONS", "NLSPATH", "PATH_LOCALE", "TERMINFO", "TERMINFO_DIRS", "TERMPATH")  # fmt: skip
_RELAYED = frozenset((1, 2, 3, 10, 12, 15))  # HUP INT QUIT USR1 USR2 TERM


class Refused(Exception):
    """A request chronus does not run: its message goes to the caller's stderr as sudo's."""


class SudoService:
    def __init__(self, users: list[str], sandboxing: Sandboxing, path: str = SOCKET_PATH) -> None:
        self.users = users
        self.sandboxing = sandboxing
        self.path = path
        self._active = 0
        self._lock = threads.Lock()
        self._sock: _socket.socket | None = None

    def start(self) -> None:
        """Bind SOCKET_PATH (replacing a previous chronus's) and serve it in a thread."""
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock.bind(self.path)
        os.chmod(self.path, 0o666)  # who may is decided per connection, by its uid
        sock.listen(16)
        self._sock = sock
        threads.start_thread(self._accept_loop)
        log.info("sudo for %s on %s", ",".join(self.users), self.path)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock._accept()  # type: ignore[attr-defined]
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.ECONNABORTED, errno.EMFILE, errno.ENFILE):
                    continue
                log.warning("sudo service stops: %s", exc)
                return
            conn = _socket.socket(fileno=conn)
            with self._lock:
                full = self._active >= MAX_CONNECTIONS
                if not full:
                    self._active += 1
            if full:
                conn.close()  # dsec-sudo: "went away before the command ended"
                continue
            try:
                threads.start_thread(self._serve, conn)
            except RuntimeError:
                with self._lock:
                    self._active -= 1
                conn.close()

    def _serve(self, conn: _socket.socket) -> None:
        fds: list[int] = []
        try:
            fds, body = _receive(conn)
            try:
                argv, env, cwd, creds = self._prepare(conn, body)
                pid = self._spawn(argv, env, cwd, creds, fds)
            except Refused as exc:
                _say(fds, f"sudo: {exc}\n")
                conn.sendall(b"X 1 0\n")
                return
            for fd in fds:
                os.close(fd)
            fds = []
            code, sig = self._supervise(conn, pid)
            conn.sendall(b"X %d %d\n" % (code, sig))
        except (OSError, ValueError) as exc:
            log.info("sudo request dropped: %s", exc)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()
            with self._lock:
                self._active -= 1

    def _prepare(
        self, conn: _socket.socket, body: bytes
    ) -> tuple[list[str], dict[str, str], str, tuple[int, int, list[int]]]:
        fields = body.split(b"\0")
        if not fields or fields[-1] != b"":
            raise ValueError("malformed request")
        text = [f.decode("utf-8", "surrogateescape") for f in fields[:-1]]
        if len(text) < 7 or text[0] != VERSION:
            raise ValueError("not a dsec-sudo/1 request")
        target, mode, preserve, cwd, chdir_to = text[1:6]
        rest = text[6:]
        argv, rest = _counted(rest)
        assignments, rest = _counted(rest)
        caller_env_list, rest = _counted(rest)
        if rest:
            raise ValueError("trailing fields")

        uid = struct.unpack("3i", conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))[1]
        caller = self._caller(uid)
        try:
            account = resolve_user(target)
        except ChronusError:
            raise Refused(f"unknown user {target}") from None
        caller_env = dict(v.split("=", 1) for v in caller_env_list if "=" in v)
        env = _environment(caller_env, account, caller, mode, preserve, argv)
        for item in assignments:
            name, _, value = item.partition("=")
            if not _is_name(name):
                raise Refused(f"{item}: not a variable assignment")
            env[name] = value
        shell = account.shell or "/bin/sh"
        if "s" in mode:
            shell = caller_env.get("SHELL") or shell
        if "i" in mode or "s" in mode:
            script = " ".join(_escape(a) for a in argv)
            argv = [shell, "-l"] if "i" in mode else [shell]
            if script:
                argv += ["-c", script]
        if "i" in mode:
            cwd = account.home if os.path.isdir(account.home) else "/"
        if chdir_to:
            cwd = chdir_to
        if not cwd:
            cwd = "/"
        return argv, env, cwd, (account.uid, account.gid, account.groups)

    def _caller(self, uid: int) -> User:
        """The caller's account if it may use sudo, else Refused (in sudo's words)."""
        try:
            caller = resolve_user(str(uid))
        except ChronusError:
            caller = User(str(uid), uid, uid, "/", [uid])
        if uid == 0:
            return caller
        for name in self.users:
            try:
                if resolve_user(name).uid == uid:
                    return caller
            except ChronusError:
                continue
        raise Refused(
            f"{caller.name} is not in the sudoers file (the sandbox's sudo_users: "
            f"{', '.join(self.users)})"
        )

    def _spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        creds: tuple[int, int, list[int]],
        fds: list[int],
    ) -> int:
        try:
            return spawn(
                argv,
                env,
                cwd,
                stdin=fds[0],
                stdout=fds[1],
                stderr=fds[2],
                ruleset_fd=self.sandboxing.for_exec(),
                syscall_filter=self.sandboxing.filter,
                creds=creds,
            )
        except SpawnError as exc:
            if exc.step == "exec" and exc.errno == errno.ENOENT:
                raise Refused(f"{argv[0]}: command not found") from None
            if exc.step == "chdir":
                reason = os.strerror(exc.errno)
                raise Refused(f"unable to change directory to {cwd}: {reason}") from None
            raise Refused(f"unable to run {argv[0]}: {exc}") from None
        except BlockingIOError:
            raise Refused("the sandbox is at its pids limit: no process for the command") from None

    def _supervise(self, conn: _socket.socket, pid: int) -> tuple[int, int]:
        """Relay signals until the command exits; kill its session if the caller goes away."""
        pidfd = os.pidfd_open(pid)
        poll = poller.Poller()
        try:
            poll.register(conn, poller.EVENT_READ, "caller")
            poll.register(pidfd, poller.EVENT_READ, "command")
            while True:
                for key, _ in poll.select(None):
                    if key.data == "command":
                        return decode_status(os.waitpid(pid, 0)[1])
                    data = conn.recv(64)
                    if not data:  # dsec-sudo is gone: so is its command
                        kill_session(pid, pid)
                        poll.unregister(conn)
                        continue
                    for sig in data:
                        if sig in _RELAYED:
                            try:
                                os.kill(pid, sig)
                            except ProcessLookupError:
                                pass
        finally:
            poll.close()
            os.close(pidfd)


def _receive(conn: _socket.socket) -> tuple[list[int], bytes]:
    """The length prefix with its three descriptors, then the body; a malformed request is a
    ValueError, with every descriptor it brought closed."""
    size = _socket.CMSG_SPACE(3 * 4)
    head, ancillary, _flags, _addr = conn.recvmsg(4, size)
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            n = len(data) // 4
            fds += list(struct.unpack(f"{n}i", data[: n * 4]))
    try:
        for fd in fds:
            os.set_inheritable(fd, False)
        if len(fds) != 3 or len(head) != 4:
            raise ValueError("a request needs its length and three descriptors")
        (length,) = struct.unpack("<I", head)
        if length > MAX_BODY:
            raise ValueError("request too large")
        body = bytearray()
        while len(body) < length:
            chunk = conn.recv(min(length - len(body), 1 << 20))
            if not chunk:
                raise ValueError("request cut short")
            body += chunk
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds, bytes(body)


def _counted(fields: list[str]) -> tuple[list[str], list[str]]:
    if not fields or not fields[0].isdigit():
        raise ValueError("malformed count")
    n = int(fields[0])
    if n > len(fields) - 1:
        raise ValueError("count past the end")
    return fields[1 : 1 + n], fields[1 + n :]


def _is_name(name: str) -> bool:
    return bool(name) and not name[0].isdigit() and all(c.isalnum() or c == "_" for c in name)


def _dropped(name: str) -> bool:
    return name in DROP or name.startswith(DROP_PREFIXES)


def _environment(
    caller_env: dict[str, str],
    account: User,
    caller: User,
    mode: str,
    preserve: str,
    argv: list[str],
) -> dict[str, str]:
    if "E" in mode:
        env = {k: v for k, v in caller_env.items() if not _dropped(k)}
    else:
        env = {
            k: v
            for k, v in caller_env.items()
            if (k in KEEP or k.startswith("LC_")) and not _dropped(k)
        }
    for name in filter(None, preserve.split(",")):
        if name in caller_env and not _dropped(name):
            env[name] = caller_env[name]
    env.update(
        HOME=account.home or "/",
        SHELL=account.shell or "/bin/sh",
        USER=account.name,
        LOGNAME=account.name,
        MAIL=f"/var/mail/{account.name}",
        PATH=SECURE_PATH,
        SUDO_USER=caller.name,
        SUDO_UID=str(caller.uid),
        SUDO_GID=str(caller.gid),
        SUDO_COMMAND=" ".join(argv)[:4096],
    )
    return env


def _escape(arg: str) -> str:
    """sudo's quoting of a command for `shell -c` (-i, -s): a backslash before every character
    but letters, digits, `_`, `-` and `$`."""
    return "".join(c if c.isalnum() or c in "_-$" else "\\" + c for c in arg)


def _say(fds: list[int], text: str) -> None:
    if len(fds) == 3:
        try:
            os.write(fds[2], text.encode())
        except OSError:
            pass
