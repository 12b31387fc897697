"""Which folders are installed as which packages; everything else is in pyproject.toml.

The design card keeps the plugins a user copies and adds to in top-level folders beside mmrl/.
They install under mmrl.plugins (import names stay under mmrl.; no top-level package named
`data` or `rewards` lands in site-packages): a wheel carries them in mmrl/plugins/, an editable
install imports them in place.
"""
from setuptools import find_packages, setup

PLUGIN_FOLDERS = {"mmrl.plugins.processors": "processors", "mmrl.plugins.rewards": "rewards",
                  "mmrl.plugins.data": "data"}

packages = find_packages(include=["mmrl", "mmrl.*"])
for package, folder in PLUGIN_FOLDERS.items():
    packages += [package] + [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=PLUGIN_FOLDERS)
