"""Package discovery for the folder -> import-name mapping: engine/ -> kvship and
operator/kvship_operator/ -> kvship_operator. operator/ itself holds no __init__.py, so it can
never shadow the standard library's `operator` module, whatever the working directory."""
from setuptools import find_packages, setup


def _packages(root: str, name: str) -> list[str]:
    return [name] + [f"{name}.{sub}" for sub in find_packages(root)]


setup(packages=_packages("engine", "kvship") + _packages("operator/kvship_operator", "kvship_operator"))
