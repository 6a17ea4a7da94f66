"""Build gn_mx: CMake compiles libgn_mx.so against the installed mxnet wheel's lib_api.

The op library must match the MXNet it is loaded into, so the build needs `mxnet` importable:
    pip install 'mxnet==1.9.1' 'numpy<1.24'        # or mxnet-cu112==1.9.1
    pip install --no-build-isolation .             # -e for development
`mxnet` is not a hard requirement (it would replace a user's mxnet-cu112 with the CPU wheel);
the extras `gn_mx[cpu]` / `gn_mx[cu112]` name the supported wheels.

Environment: GNMX_BUILD_TYPE (Release), GNMX_CMAKE_ARGS (extra CMake arguments),
GNMX_JOBS (parallel build jobs), GNMX_CUDA (unset: CUDA kernels when nvcc is found and the installed
MXNet is a CUDA build; 1: force on; 0: CPU only), GNMX_CUDA_ARCH (e.g. "80;90"; default: chosen
from the nvcc version).
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_NAME = "libgn_mx.so"


def package_version():
    """The version is defined once, as ``__version__`` in python/gn_mx/__init__.py."""
    with open(os.path.join(HERE, "python", "gn_mx", "__init__.py")) as f:
        m = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    if not m:
        raise RuntimeError("python/gn_mx/__init__.py defines no __version__")
    return m.group(1)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def get_ext_filename(self, ext_name):
        return os.path.join(*ext_name.split(".")[:-1], LIB_NAME)

    def build_extension(self, ext):
        build_dir = os.path.join(HERE, "build", "cmake")
        os.makedirs(build_dir, exist_ok=True)
        cfg = os.environ.get("GNMX_BUILD_TYPE", "Release")
        # CMake finds the mxnet wheel (lib_api.h/.cc, version, CUDA build) through this interpreter.
        args = [f"-DCMAKE_BUILD_TYPE={cfg}", f"-DPython3_EXECUTABLE={sys.executable}"]
        args += self.extra_cmake_args()
        args += shlex.split(os.environ.get("GNMX_CMAKE_ARGS", ""))
        try:
            subprocess.run(["cmake", "-S", HERE, "-B", build_dir] + args, check=True)
        except subprocess.CalledProcessError:
            raise RuntimeError("gn_mx: CMake configuration failed (see its message above: usually "
                               "mxnet==1.9.1 / mxnet-cu112==1.9.1 is not installed in "
                               f"{sys.executable}; build with pip install --no-build-isolation .)"
                               ) from None
        jobs = os.environ.get("GNMX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", build_dir, "--target", "gn_mx", "-j", jobs],
                       check=True)
        dest = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(os.path.join(build_dir, LIB_NAME), dest)

    def extra_cmake_args(self):
        force = os.environ.get("GNMX_CUDA", "").strip().lower()
        if force in ("1", "on", "true", "yes"):
            args = ["-DGNMX_CUDA=ON"]
        elif force in ("0", "off", "false", "no"):
            args = ["-DGNMX_CUDA=OFF"]
        else:
            args = ["-DGNMX_CUDA=AUTO"]
        arch = os.environ.get("GNMX_CUDA_ARCH", "").strip()
        if arch:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={arch}")
        return args


setup(
    name="gn_mx",
    version=package_version(),
    description="Native GroupNorm and Decorrelated BatchNorm ops for MXNet 1.9 (CPU/CUDA)",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("gn_mx.libgn_mx")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.8,<3.12",
    install_requires=[],
    extras_require={
        "cpu": ["mxnet==1.9.1", "numpy<1.24"],
        "cu112": ["mxnet-cu112==1.9.1", "numpy<1.24"],
        "test": ["pytest"],
        # ONNX export (mx.onnx.export_model with gn_mx ops) and running the result
        "onnx": ["onnx>=1.15,<1.18", "onnxruntime>=1.17", "protobuf<8", "numpy<1.24"],
    },
    zip_safe=False,
)
