"""What a ``submit`` hands to ``execve``: its command (``argv``), its folder (``cwd``) and its
environment (``environ``, ``env``), checked when the request comes, so that a job the store
accepts can start as far as the kernel's call goes.  A run's start
(:meth:`launcher.cluster.runs.Run.start`, ``subprocess.Popen``) raises ``ValueError`` for a NUL
in any string or a ``=`` in an environment name, and ``UnicodeEncodeError`` for a string the
file system encoding cannot carry (a lone surrogate from JSON's ``"\\ud800"``); the kernel
refuses a string over ``MAX_ARG_STRLEN`` (E2BIG).  Names follow POSIX (IEEE Std 1003.1, Base
Definitions 8.1: "uppercase letters, digits, and the underscore ... and do not begin with a
digit"; lowercase accepted, as every shell does): ``[A-Za-z_][A-Za-z0-9_]*``.

Each check raises :class:`BadExecInput` (a ``ValueError`` with ``status`` 400, what the
server answers as a refusal): one line naming the field and what is wrong.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_STRING_BYTES = 128 * 1024 - 1  # Linux's MAX_ARG_STRLEN (32 pages) less the NUL
MAX_ARGV_ITEMS = 4096              # a training command's words (a sanity bound)
MAX_ENVIRON_ITEMS = 4096           # an environment's variables (a sanity bound)
MAX_NAME_BYTES = 1024              # an environment variable's name


class BadExecInput(ValueError):
    """A ``submit`` field ``execve`` could not take (HTTP 400), one line."""

    status = 400


def _encoded(value: str, what: str) -> bytes:
    """``value`` as ``execve`` gets it (``os.fsencode``), checked: no NUL, encodable, at most
    :data:`MAX_STRING_BYTES`."""
    if "\x00" in value:
        raise BadExecInput(f"{what} contains a NUL character")
    try:
        data = os.fsencode(value)
    except UnicodeError:
        raise BadExecInput(f"{what} is not encodable text (a lone surrogate?)") from None
    if len(data) > MAX_STRING_BYTES:
        raise BadExecInput(f"{what} is {len(data)} bytes long (at most {MAX_STRING_BYTES})")
    return data


def check_argv(argv) -> List[str]:
    """A job's command: a non-empty list of at most :data:`MAX_ARGV_ITEMS` strings, each
    without NUL, encodable, at most :data:`MAX_STRING_BYTES` bytes.

    Returns:
        ``argv`` itself.
    Raises:
        BadExecInput: one line naming the first bad element."""
    if not isinstance(argv, list) or not argv:
        raise BadExecInput("no training command given (e.g. -- python train.py)")
    if len(argv) > MAX_ARGV_ITEMS:
        raise BadExecInput(f"the training command has {len(argv)} words (at most "
                           f"{MAX_ARGV_ITEMS})")
    for i, a in enumerate(argv):
        if not isinstance(a, str):
            raise BadExecInput(f"argv[{i}] must be a string, got {type(a).__name__}")
        _encoded(a, f"argv[{i}]")
    if not argv[0]:
        raise BadExecInput("argv[0] is empty: no training command given")
    return argv


def check_environ(value, what: str) -> Dict[str, str]:
    """An environment (``environ``: the one ``submit`` ran in; ``env``: its ``--env`` pairs):
    None -> {}; else an object of at most :data:`MAX_ENVIRON_ITEMS` names matching
    :data:`NAME` (at most :data:`MAX_NAME_BYTES`) to strings without NUL, each ``NAME=VALUE``
    at most :data:`MAX_STRING_BYTES` bytes.

    Raises:
        BadExecInput: one line naming the first bad variable (its name cut to 40 characters,
            shown with ``repr``)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadExecInput(f"{what} must map names to strings")
    if len(value) > MAX_ENVIRON_ITEMS:
        raise BadExecInput(f"{what} has {len(value)} variables (at most {MAX_ENVIRON_ITEMS})")
    for k, v in value.items():
        shown = repr(k[:40]) if isinstance(k, str) else repr(k)
        if not isinstance(v, str):
            raise BadExecInput(f"{what} {shown} must be a string, got {type(v).__name__}")
        if not isinstance(k, str) or len(k) > MAX_NAME_BYTES or not NAME.fullmatch(k):
            raise BadExecInput(f"{what}: {shown} is not a variable name (letters, digits and "
                               f"_, not starting with a digit)")
        _encoded(f"{k}={v}", f"{what} {shown}")
    return value


def check_path(value, what: str) -> str:
    """A path ``submit`` names (``cwd``, ``checkpoint_dir``): a string without NUL, encodable,
    at most :data:`MAX_STRING_BYTES` bytes.

    Raises:
        BadExecInput: one line."""
    if not isinstance(value, str):
        raise BadExecInput(f"{what} must be a path (a string), got {type(value).__name__}")
    _encoded(value, what)
    return value


def check_name(value) -> str:
    """A job's display name (``submit --name``): printable text of at most 64 characters.  Every
    user's ``queue``, ``status`` and ``top`` print it, so a control character (an escape
    sequence that retitles or recolours their terminal, a newline that fakes a row) is refused.

    Raises:
        BadExecInput: one line."""
    if not isinstance(value, str):
        raise BadExecInput(f"name must be a string, got {type(value).__name__}")
    if not value.isprintable():
        raise BadExecInput(f"name {value!r} has a control character (every user's status "
                           "prints it): use printable text")
    if len(value) > 64:
        raise BadExecInput(f"name is {len(value)} characters long: at most 64")
    return value
