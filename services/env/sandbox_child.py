"""Runs one `python` tool call inside the sandbox; started by services.env.sandbox as `python -I <this file> LIMITS`.

Standard library only, run by path (never imported by the service). The code arrives on stdin. Steps:
1. a new network, PID and mount namespace (a user namespace too when not root): no interface but a downed
   loopback, every process the code starts dies with the namespace's first process, and every mount is read-only
   but the working directory;
2. fork that first process (PID 1 of the namespace), which forks the code's process and reaps it;
3. in the code's process: rlimits (CPU seconds, address space, file size, processes), then the code; a last
   expression's value is printed, as in a notebook. Root ignores RLIMIT_NPROC, so as root the service puts the
   whole call in a pids cgroup, or where it may not, a seccomp filter forbids starting processes at all.
LIMITS["network"] is "namespace" (the service found namespaces at start: get them or fail) or "sockets" (it did not:
the socket module is disabled in the code's process instead, best effort only, which the service reports).
Exit status: the code's, or 128 + the signal that killed it; EXIT_SETUP when the sandbox could not be built.
"""

import ast
import ctypes
import json
import os
import resource
import sys
import traceback

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1   # 442 on x86_64 and aarch64
EXIT_SETUP = 97


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def unshare_namespaces() -> bool:
    """New network, PID and mount namespaces (and a user namespace when not root); False when the kernel refuses."""
    flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | (0 if os.geteuid() == 0 else CLONE_NEWUSER)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.unshare(flags) == 0
    except (OSError, AttributeError):
        return False


def read_only_but(workdir: str) -> None:
    """In the call's own mount namespace: every mount read-only (mount_setattr, Linux 5.12+), then the working
    directory bound on itself writable again. Writing anywhere else fails with EROFS, whatever the user."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    def setattr_(path: str, flags: int, attr: MountAttr) -> None:
        check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr),
                           ctypes.sizeof(attr)), f"mount_setattr {path}")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")
    setattr_("/", AT_RECURSIVE, MountAttr(attr_set=MOUNT_ATTR_RDONLY))
    check(libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND, None), f"bind {workdir}")
    setattr_(workdir, 0, MountAttr(attr_clr=MOUNT_ATTR_RDONLY))
    os.chdir(workdir)          # the bind mount, not the read-only directory under it


def apply_limits(limits: dict) -> None:
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() != 0:
        # RLIMIT_NPROC counts the user's processes: in its own user namespace only the sandbox's, otherwise every
        # process of the service's user, which the limit then adds to. Root ignores it (its pids cgroup limits it).
        own = 0 if limits["user_namespace"] else _tasks_of(os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (own + limits["processes"], own + limits["processes"]))
    elif not limits.get("cgroup"):
        forbid_new_processes()


def _tasks_of(uid: int) -> int:
    """Threads and processes of `uid` (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return count


# seccomp-BPF pieces (linux/filter.h, linux/seccomp.h): instruction codes, return values, prctl options.
LD_ABS, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
EAGAIN, ENOSYS, CLONE_THREAD = 11, 38, 0x00010000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
# machine -> (AUDIT_ARCH value, syscall numbers that start a process)
SYSCALLS = {"x86_64": (0xC000003E, {"clone": 56, "fork": 57, "vfork": 58, "clone3": 435}),
            "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435})}


def forbid_new_processes() -> None:
    """A seccomp filter that fails fork, vfork and clone without CLONE_THREAD (threads still start; clone3 answers
    ENOSYS so the C library falls back to clone). For a root service with no pids cgroup, which RLIMIT_NPROC
    cannot bound: the code may start no process at all."""
    import platform
    import struct

    if platform.machine() not in SYSCALLS:
        raise OSError(f"no seccomp filter for {platform.machine()}")
    audit, nr = SYSCALLS[platform.machine()]
    # (code, k, jump-if-true label, jump-if-false label); labels resolve to forward offsets below.
    prog = [("arch", LD_ABS, 4, None, None), (None, JEQ, audit, None, "allow"), (None, LD_ABS, 0, None, None),
            (None, JEQ, nr["clone3"], "enosys", None), (None, JEQ, nr["clone"], "flags", None),
            *[(None, JEQ, nr[name], "eagain", None) for name in ("fork", "vfork") if name in nr],
            ("allow", RET, RET_ALLOW, None, None), ("flags", LD_ABS, 16, None, None),
            (None, JSET, CLONE_THREAD, "allow_thread", "eagain"), ("allow_thread", RET, RET_ALLOW, None, None),
            ("eagain", RET, RET_ERRNO | EAGAIN, None, None), ("enosys", RET, RET_ERRNO | ENOSYS, None, None)]
    where = {label: i for i, (label, *_rest) in enumerate(prog) if label}
    raw = b"".join(struct.pack("HBBI", code, where[jt] - i - 1 if jt else 0, where[jf] - i - 1 if jf else 0, k)
                   for i, (_, code, k, jt, jf) in enumerate(prog))
    buf = ctypes.create_string_buffer(raw)
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    fprog_buf = ctypes.create_string_buffer(fprog)
    ulong = ctypes.c_ulong   # prctl is variadic: a pointer must not pass as a 32-bit int
    if libc.prctl(PR_SET_NO_NEW_PRIVS, ulong(1), ulong(0), ulong(0), ulong(0)) != 0 or \
            libc.prctl(PR_SET_SECCOMP, ulong(SECCOMP_MODE_FILTER), ulong(ctypes.addressof(fprog_buf)), ulong(0),
                       ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


def join_cgroup(path: str) -> None:
    """Moves this process (and so everything it starts) into the pids cgroup the service made for this call."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def block_sockets() -> None:
    """Best effort without a network namespace: no socket can be created through Python's socket modules."""
    import _socket
    import socket

    class NoSocket:
        def __init__(self, *args, **kwargs):
            raise PermissionError("network access is disabled in the python tool")

    socket.socket = _socket.socket = NoSocket  # type: ignore[misc,assignment]
    socket.create_connection = NoSocket  # type: ignore[assignment]


def run_code(code: str) -> int:
    """Executes the code as a module named __main__; a last bare expression's value is printed."""
    try:
        tree = ast.parse(code, "<tool>", "exec")
    except SyntaxError:
        traceback.print_exc(limit=0)
        return 1
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(tree, "<tool>", "exec"), scope)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
            if value is not None:
                print(repr(value))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - the model reads the traceback of its own code
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        return 1
    return 0


def wait_exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def main() -> None:
    limits = json.loads(sys.argv[1])
    code = sys.stdin.read()
    if limits.get("cgroup"):
        try:
            join_cgroup(limits["cgroup"])
        except OSError as e:
            print(f"sandbox: cannot join the pids cgroup: {e}", file=sys.stderr)
            os._exit(EXIT_SETUP)
    # The service probed namespaces once at start and reports what it found; every call does the same.
    isolated = unshare_namespaces() if limits["network"] == "namespace" else False
    limits["user_namespace"] = isolated and os.geteuid() != 0
    if not isolated and limits["network"] == "namespace":
        print("sandbox: the kernel refused a network namespace", file=sys.stderr)
        os._exit(EXIT_SETUP)
    if isolated:
        try:
            read_only_but(os.getcwd())
        except OSError as e:
            print(f"sandbox: cannot make the filesystem read-only: {e}", file=sys.stderr)
            os._exit(EXIT_SETUP)
    init = os.fork()
    if init == 0:   # PID 1 of the namespace: when it exits, every process the code started is killed
        worker = os.fork()
        if worker == 0:
            try:
                apply_limits(limits)
                if not isolated:
                    block_sockets()
            except (OSError, ValueError) as e:
                print(f"sandbox: setup failed: {e}", file=sys.stderr)
                os._exit(EXIT_SETUP)
            sys.stdout.flush()
            code_rc = run_code(code)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code_rc & 0xFF)
        os._exit(wait_exit_code(worker))
    os._exit(wait_exit_code(init))


if __name__ == "__main__":
    main()
