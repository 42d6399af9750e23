"""What Python would run for a command line: its interpreter, interpreter flags, and what it runs (a module,
code, or a script such as the `vllm` console entry), found as the shell and the kernel would find them
(PATH, then the script's `#!` line). Pure: reads files, runs nothing."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil

_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
# pip's launcher for interpreter paths too long for a #! line: `'''exec' "/path/python" "$0" "$@"`
_PIP_SH_EXEC = re.compile(r"""^'''exec' "?([^"]+?)"? "\$0" "\$@"\s*$""")
_NO_ARG = set("bBdEhiIOqsSuvVxP?")  # one-letter flags without an argument
_WITH_ARG = set("XW")
APPLIED_PER_RUN = set("uBWq")  # flags the warm interpreter applies to each engine itself
_SHEBANG_MAX = 512


class NotPython(Exception):
    """The command is not one the warm interpreter can run (the message says why, in a few words)."""


@dataclasses.dataclass
class PythonCommand:
    interpreter: str  # absolute, symlinks kept (a venv's bin/python is a symlink that selects the venv)
    flags: list[str]  # interpreter options before what runs, one per entry: "-u", "-X" "dev" as "-Xdev", ...
    kind: str  # "module" | "code" | "script"
    target: str  # module name, code, or script path (as the kernel passes it)
    args: list[str]  # sys.argv[1:]

    @property
    def fixed_flags(self) -> list[str]:
        """Startup flags that the warm interpreter cannot change per engine (compared with its own)."""
        return sorted(f for f in self.flags if f[1] not in APPLIED_PER_RUN)

    def flag(self, letter: str) -> list[str]:
        return [f[2:] for f in self.flags if f[1] == letter]


def find_program(name: str, env: dict[str, str], cwd: str) -> str | None:
    """The file a shell would run for `name` (an absolute path; None if none is found)."""
    if "/" in name:
        path = os.path.join(cwd, name)
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found and not os.path.isabs(found):
        found = os.path.join(cwd, found)
    return found


def is_python_name(path: str) -> bool:
    return bool(_PYTHON_NAME.match(os.path.basename(path)))


def shebang(path: str) -> list[str] | None:
    """The interpreter line of a script as a list (interpreter first); pip's /bin/sh trick understood."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SHEBANG_MAX)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    lines = head.split(b"\n")
    first = lines[0][2:].decode(errors="replace").strip()
    words = first.split(None, 1)
    if not words:
        return None
    if words[0] in ("/bin/sh", "/usr/bin/sh") and len(lines) > 1:
        m = _PIP_SH_EXEC.match(lines[1].decode(errors="replace"))
        return [m.group(1)] if m else None
    return words  # the kernel passes everything after the interpreter as one argument


def resolve(argv: list[str], env: dict[str, str], cwd: str) -> PythonCommand:
    """The Python invocation behind `argv`; NotPython when it is not one (or not one we can run warm)."""
    if not argv:
        raise NotPython("no command")
    program = find_program(argv[0], env, cwd)
    if program is None:
        raise NotPython(f"{argv[0]}: not found")
    if is_python_name(program):
        return parse_python_argv(program, argv[1:])
    line = shebang(program)
    if line is None:
        raise NotPython(f"{argv[0]} is not a Python program")
    interp, extra = line[0], (line[1] if len(line) > 1 else "")
    if os.path.basename(interp) == "env":  # `#!/usr/bin/env python3`
        words = extra.split()
        if len(words) != 1:
            raise NotPython(f"{argv[0]}: #!{interp} {extra} is not a plain `env python`")
        found = find_program(words[0], env, cwd)
        if found is None:
            raise NotPython(f"{argv[0]}: {words[0]} not found")
        interp, extra = found, ""
    if not is_python_name(interp):
        raise NotPython(f"{argv[0]} runs {interp}, not Python")
    return parse_python_argv(interp, (shlex.split(extra) if extra else []) + [program] + argv[1:])


def parse_python_argv(interpreter: str, args: list[str]) -> PythonCommand:
    """`python [flags] (-m MOD | -c CODE | SCRIPT) ARGS...` (what CPython's own option parser accepts)."""
    flags: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if a == "-" or not a.startswith("-"):
            break
        if a.startswith("--"):
            raise NotPython(f"python option {a} is not supported warm")
        j = 1
        while j < len(a):
            ch = a[j]
            if ch in ("m", "c"):
                rest = a[j + 1:]
                if rest:
                    value, tail = rest, args[i + 1:]
                elif i + 1 < len(args):
                    value, tail = args[i + 1], args[i + 2:]
                else:
                    raise NotPython(f"python -{ch} needs an argument")
                return PythonCommand(interpreter, flags, "module" if ch == "m" else "code", value, tail)
            if ch in _WITH_ARG:
                rest = a[j + 1:]
                if not rest:
                    i += 1
                    if i >= len(args):
                        raise NotPython(f"python -{ch} needs an argument")
                    rest = args[i]
                flags.append(f"-{ch}{rest}")
                break
            if ch not in _NO_ARG:
                raise NotPython(f"unknown python option -{ch}")
            if ch in "hV?i":
                raise NotPython(f"python -{ch} is not an engine")
            flags.append(f"-{ch}")
            j += 1
        i += 1
    if i >= len(args):
        raise NotPython("python without a script, -m or -c (an interactive interpreter)")
    if args[i] == "-":
        raise NotPython("python - reads its program from stdin")
    return PythonCommand(interpreter, flags, "script", args[i], args[i + 1:])


def fixed_flags_of(orig_argv: list[str]) -> list[str]:
    """The startup flags of a running interpreter, from its sys.orig_argv."""
    try:
        return parse_python_argv(orig_argv[0], orig_argv[1:]).fixed_flags
    except NotPython:
        return []
