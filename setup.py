"""Builds the native CPU collective engine (native/) into ``sparktrain/_collective*.so``.

The library is loaded with ctypes, not imported, so it needs no Python headers. The extension
is optional: where there is no C compiler the install still succeeds, and sparktrain falls back
to TensorFlow's own ring with one warning (see ``sparktrain.native``).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sparktrain._collective",
            sources=["native/collective.c", "native/reduce.c"],
            include_dirs=["native"],
            extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror", "-pthread"],
            extra_link_args=["-pthread"],
            libraries=["rt"],
            optional=True,
        )
    ]
)
