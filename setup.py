"""The package list lives here, not in pyproject.toml, for one mapping pyproject cannot write beside
a package search: conf/ (the Hydra configs, at the top of the checkout beside testbed/) installs
as the package testbed.conf, so a wheel carries its configs. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["testbed*", "analysis*"]), "testbed.conf"], package_dir={"testbed.conf": "conf"}
)
