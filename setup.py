"""Build gn_mx: CMake compiles libgn_mx.so against the installed mxnet wheel's lib_api.

The op library must match the MXNet it is loaded into, so the build needs `mxnet` importable:
    pip install 'mxnet==1.9.1' 'numpy<1.24'        # or mxnet-cu112==1.9.1
    pip install --no-build-isolation .             # -e for development
`mxnet` is not a hard requirement (it would replace a user's mxnet-cu112 with the CPU wheel);
the extras `gn_mx[cpu]` / `gn_mx[cu112]` name the supported wheels.

The binary wheel (CPU + CUDA 11.8 kernels, one py3-none-manylinux wheel for every supported
Python, mxnet and mxnet-cu112) is built by tools/build_wheel.sh; see docs/install.md.

Environment: GNMX_BUILD_TYPE (Release), GNMX_CMAKE_ARGS (extra CMake arguments),
GNMX_JOBS (parallel build jobs), GNMX_CUDA (unset: CUDA kernels when nvcc is found and the installed
MXNet is a CUDA build; 1: force on; 0: CPU only), GNMX_CUDA_ARCH (e.g. "80;90"; default: chosen
from the nvcc version), GNMX_BUILD_DIR (CMake build folder, default build/cmake), GNMX_STRIP=1
(strip the library's symbol table before packaging).
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from wheel.bdist_wheel import bdist_wheel
except ImportError:  # wheel not installed: no bdist_wheel customisation needed
    bdist_wheel = None

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
        build_dir = os.environ.get("GNMX_BUILD_DIR") or os.path.join(HERE, "build", "cmake")
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
        if os.environ.get("GNMX_STRIP", "") == "1":
            subprocess.run(["strip", "--strip-unneeded", dest], check=True)

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


CMDCLASS = {"build_ext": CMakeBuild}
if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        """py3-none-<platform>: the library uses no CPython API (MXNet loads it through lib_api's C
        ABI), so one wheel serves every supported Python; tools/build_wheel.sh retags the platform
        to manylinux with auditwheel."""

        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    CMDCLASS["bdist_wheel"] = PlatformWheel

# The public repository's address, once it has one (the project URLs below follow from it); left
# empty rather than guessed.
URL = os.environ.get("GNMX_PROJECT_URL", "").rstrip("/")
PROJECT_URLS = {"Source": URL, "Documentation": URL + "/tree/main/docs",
                "Changelog": URL + "/blob/main/CHANGELOG.md", "Issues": URL + "/issues"} if URL else {}

setup(
    name="gn_mx",
    version=package_version(),
    description="Native GroupNorm and Decorrelated BatchNorm ops for MXNet 1.9 (CPU/CUDA)",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    url=URL or None,
    project_urls=PROJECT_URLS,
    keywords=["mxnet", "group normalization", "decorrelated batch normalization", "cuda"],
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.8",
        "Programming Language :: Python :: 3.9",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Environment :: GPU :: NVIDIA CUDA :: 11.8",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("gn_mx.libgn_mx")],
    cmdclass=CMDCLASS,
    python_requires=">=3.8,<3.12",
    install_requires=[],
    extras_require={
        "cpu": ["mxnet==1.9.1", "numpy<1.24"],
        "cu112": ["mxnet-cu112==1.9.1", "numpy<1.24"],
        "test": ["pytest"],
        # ONNX export (mx.onnx.export_model with gn_mx ops) and running the result
        # (the pins of requirements-dev.txt are the tested pairs: onnxruntime 1.19.2 is the last
        # for Python 3.8/3.9; gn_mx.onnx.export_model writes opset 17 by default)
        "onnx": ["onnx>=1.15,<1.18", "onnxruntime>=1.17,<1.20; python_version < '3.10'",
                 "onnxruntime>=1.17; python_version >= '3.10'", "protobuf<8", "numpy<1.24"],
    },
    zip_safe=False,
)
