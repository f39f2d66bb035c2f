"""Builds the native CPU collective engine (native/) into ``sparktrain/_collective*.so``.

The library is loaded with ctypes, not imported, so it needs no Python headers. The extension
is optional: where there is no C compiler the install still succeeds, and sparktrain falls back
to TensorFlow's own ring with one warning (see ``sparktrain.engine``).

The TensorFlow kernels over the engine (``native/tf_kernels.cc``) are not built here: pip builds
in an environment without TensorFlow. Their source and the engine's header are copied into the
package (``sparktrain/_native/``), and ``sparktrain.tensorflow.kernels`` compiles them at first
use.
"""
import glob
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

KERNEL_SOURCES = ["native/tf_kernels.cc", "native/tf_ragged_kernels.cc", "native/tf_kernel.h", "native/tf_sequencer.cc",
                  "native/tf_sequencer.h", "native/collective.h"]


class BuildPy(build_py):
    """Also puts the kernels' sources into the built package, for ``sparktrain.tensorflow.kernels``."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "sparktrain", "_native")
        os.makedirs(target, exist_ok=True)
        for src in KERNEL_SOURCES:
            shutil.copy(src, os.path.join(target, os.path.basename(src)))

setup(
    cmdclass={"build_py": BuildPy},
    ext_modules=[
        Extension(
            "sparktrain._collective",
            sources=sorted(glob.glob("native/*.c")),
            include_dirs=["native"],
            extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror", "-pthread"],
            extra_link_args=["-pthread"],
            libraries=["rt", "dl"],  # dl: libcrypto is loaded at run time (native/crypto.c)
            optional=True,
        )
    ]
)
