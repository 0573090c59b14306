"""Packaging that setup.cfg cannot say: the CUDA sources ship inside the package.

cuda_src/ stays at the top of the repository (the simulator, NVRTC and the FFI build read it from there in
an editable install) and is installed as the package data of ``cuflash.cuda_src``, so a wheel or a plain
``pip install .`` carries every .cu/.cuh/.h/.cpp/.S file; ``cuflash._paths`` finds whichever is present.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["cuflash", "cuflash.*"]) + ["cuflash.cuda_src"],
    package_dir={"cuflash.cuda_src": "cuda_src"},
    package_data={"cuflash.cuda_src": ["**/*"]},
    exclude_package_data={"cuflash.cuda_src": ["**/__pycache__/*", "**/*.pyc"]},
)
