"""Builds the native CPU collective engine (native/) into ``sparktrain/_collective.so``, and one
wheel for every Python this package supports.

The library is loaded with ctypes, not imported: it uses no Python ABI and needs no Python
headers. So its file name carries no interpreter suffix (``_collective.so``, not
``_collective.cpython-311-x86_64-linux-gnu.so``), and the wheel is tagged ``py3-none-<platform>``:
``manylinux_2_<N>_<arch>``, where 2.N is the newest glibc symbol version the built library needs
(read from its ELF version references here, never assumed), or the plain ``linux_<arch>`` tag if
it needs any library a manylinux host need not have. The extension is optional: where there is
no C compiler the install still succeeds, the wheel holds no native code and is tagged
``py3-none-any``, and sparktrain falls back to TensorFlow's own ring with one warning (see
``sparktrain.engine``).

The TensorFlow kernels over the engine (``native/tf_kernels.cc``) and the XLA FFI handler for JAX
(``native/jax_ffi.cc``) are not built here: pip builds in an environment without TensorFlow or
jaxlib. Their sources and the engine's header are copied into the package (``sparktrain/_native/``),
and ``sparktrain.tensorflow.kernels`` and ``sparktrain._jax.ffi`` compile them at first use.
"""
import glob
import os
import re
import shutil
import struct
import sysconfig

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ENGINE = "sparktrain._collective"
KERNEL_SOURCES = ["native/tf_kernels.cc", "native/tf_ragged_kernels.cc", "native/tf_kernel.h", "native/tf_sequencer.cc",
                  "native/tf_sequencer.h", "native/reducer.cc", "native/reducer.h", "native/engine_op.h",
                  "native/collective.h"]
#: The XLA FFI handler for JAX (``sparktrain._jax.ffi`` compiles it at first use, against jaxlib).
JAX_SOURCES = ["native/jax_ffi.cc"]
#: The libraries every manylinux host has (glibc's own), which the engine may link.
MANYLINUX_LIBS = {"libc.so.6", "libpthread.so.0", "librt.so.1", "libdl.so.2", "libm.so.6",
                  "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}
#: manylinux2014's glibc: no tag below it is worth claiming.
OLDEST_GLIBC_MINOR = 17
SHT_DYNAMIC, SHT_GNU_VERNEED, DT_NEEDED = 6, 0x6FFFFFFE, 1


class BuildPy(build_py):
    """Also puts the kernels' and the JAX handler's sources into the built package, for
    ``sparktrain.tensorflow.kernels`` and ``sparktrain._jax.ffi``."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "sparktrain", "_native")
        os.makedirs(target, exist_ok=True)
        for src in KERNEL_SOURCES + JAX_SOURCES:
            shutil.copy(src, os.path.join(target, os.path.basename(src)))


class BuildExt(build_ext):
    """Names the engine ``sparktrain/_collective.so`` and links it without the interpreter's run path."""

    def get_ext_filename(self, fullname):
        # Called with the full name, and with its last part alone (distutils' get_ext_fullpath).
        ext = self.ext_map.get(fullname)
        if ext is not None and ext.name == ENGINE:
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extensions(self):
        # An interpreter built with a run path of its own (pyenv's) puts it on every extension's link
        # line; the engine links no libpython, and a wheel must not carry the build host's paths.
        self.compiler.linker_so = [a for a in self.compiler.linker_so if not a.startswith("-Wl,-rpath")]
        super().build_extensions()


def elf_needs(path):
    """The shared libraries (DT_NEEDED) and symbol versions (.gnu.version_r) a 64-bit little-endian
    ELF file needs, or None for any other file."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def string(table, offset):
        start = sections[table][4] + offset
        return data[start:data.index(b"\0", start)].decode()

    libs, versions = set(), set()
    for _, kind, _, _, offset, size, link, info, _, _ in sections:
        if kind == SHT_DYNAMIC:
            for pos in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, pos)
                if tag == DT_NEEDED:
                    libs.add(string(link, value))
        elif kind == SHT_GNU_VERNEED:
            pos = offset
            for _ in range(info):  # Verneed entries, each with its Vernaux list
                _, count, _, aux, following = struct.unpack_from("<HHIII", data, pos)
                apos = pos + aux
                for _ in range(count):
                    _, _, _, name, next_aux = struct.unpack_from("<IHHII", data, apos)
                    versions.add(string(link, name))
                    apos += next_aux
                pos += following
    return libs, versions


def manylinux_platform(path, arch):
    """``manylinux_2_<N>_<arch>`` for the library at ``path``, or None where it links beyond glibc
    (or needs a glibc-private symbol, or is no ELF this reads)."""
    needs = elf_needs(path)
    if needs is None:
        return None
    libs, versions = needs
    if not libs <= MANYLINUX_LIBS or "GLIBC_PRIVATE" in versions:
        return None
    minors = [int(m.group(1)) for m in map(re.compile(r"GLIBC_2\.(\d+)(\.\d+)?").fullmatch, versions) if m]
    return f"manylinux_2_{max(minors + [OLDEST_GLIBC_MINOR])}_{arch}"


class BdistWheel(bdist_wheel):
    """One wheel for every Python 3: ``py3-none-<platform>`` (see the module's docstring)."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False  # the engine is a platform file, even where it failed to build

    def get_tag(self):
        library = os.path.join(self.bdist_dir, *ENGINE.split(".")) + ".so"
        if not os.path.exists(library):  # no compiler (or an editable install's wheel): no native code
            return "py3", "none", "any"
        platform = sysconfig.get_platform()  # linux-x86_64
        manylinux = manylinux_platform(library, platform.split("-", 1)[-1]) if platform.startswith("linux-") else None
        return "py3", "none", manylinux or super().get_tag()[2]


setup(
    cmdclass={"build_py": BuildPy, "build_ext": BuildExt, "bdist_wheel": BdistWheel},
    ext_modules=[
        Extension(
            ENGINE,
            sources=sorted(glob.glob("native/*.c")),
            include_dirs=["native"],
            extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror", "-pthread"],
            extra_link_args=["-pthread"],
            libraries=["rt", "dl"],  # dl: libcrypto is loaded at run time (native/crypto.c)
            optional=True,
        )
    ]
)
