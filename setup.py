"""Package discovery for the folder -> import-name mapping (engine/ -> kvship, operator/ -> kvship_operator)."""
from setuptools import find_packages, setup


def _packages(root: str, name: str) -> list[str]:
    return [name] + [f"{name}.{sub}" for sub in find_packages(root)]


setup(packages=_packages("engine", "kvship") + _packages("operator", "kvship_operator"))
