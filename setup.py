"""The package's two C parts, built by the package build itself (``pip install .``,
``python -m build``, ``pip install -e .``, and ``make native`` in place), so a wheel
carries them: the server's copy loop (a plain C library loaded with ctypes, which
drops the GIL for the whole call) and the client's presence table (a CPython
extension). Everything else is declared in pyproject.toml.

Both are optional: where there is no C compiler (or no Python.h for the table), the
install still succeeds, this build says so, and kvsvc runs the same work in Python;
the server's start line and GetServerInfo then name the Python copy loop and why.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: -O3 as the copy loop was always built; the copy loop picks its CRC path
#: (SSE4.2 crc32, AVX-512 VPCLMULQDQ) at run time, so no -march here.
FLAGS = ["-O3", "-Wall", "-Wextra"]


class OptionalBuildExt(build_ext):
    """Builds what it can; a failed extension is announced on stderr (pip shows it
    with -v; the installed server says it at start) instead of failing the install."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: fall back
            what = "copy loop" if "copyloop" in ext.name else "presence table"
            print(
                f"kvsvc: the native {what} ({ext.name}) was not built ({exc}); "
                "kvsvc runs its Python one instead",
                file=sys.stderr,
            )

    def copy_file(self, infile: str, outfile: str, *args: object, **kwargs: object) -> object:
        """In place (``make native``, ``pip install -e``): a new file renamed over the
        old, never the old one rewritten, so a running server keeps the library it mapped."""
        tmp = f"{outfile}.tmp"
        _, copied = super().copy_file(infile, tmp, *args, **kwargs)  # type: ignore[misc]
        os.replace(tmp, outfile)
        return outfile, copied


setup(
    ext_modules=[
        # No PyInit: a C library in the extension's place and name, so the wheel
        # carries it as a platform file and kvsvc finds it by the interpreter's suffix.
        Extension(
            "kvsvc.server.data.native._copyloop",
            ["kvsvc/server/data/native/copyloop.c"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
        Extension(
            "kvsvc.client.native._presence",
            ["kvsvc/client/native/presence.c"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
