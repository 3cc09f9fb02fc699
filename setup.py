# Builds the native extension (hetccl._native) with cffi at install time.
from setuptools import setup

setup(cffi_modules=["native/build.py:ffibuilder"])
