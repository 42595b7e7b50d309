"""hvd_edl: elastic Horovod for PyTorch (packages hvd_edl and launcher, console scripts hvd-edl-run, hvd-edl-ctl, hvd-edl-cluster).

Horovod itself is built by the top-level CMakeLists.txt (see the README), not by this file.
"""
from setuptools import find_packages, setup

setup(
    name="hvd_edl",
    version="0.1.0",
    description="Elastic training for Horovod/PyTorch: stop-free scale-out, graceful scale-in",
    packages=find_packages(include=["hvd_edl", "hvd_edl.*", "launcher", "launcher.*"]),
    python_requires=">=3.9",
    install_requires=["requests", "filelock", "psutil", "numpy", "prometheus-client", "rich"],
    entry_points={"console_scripts": ["hvd-edl-run = launcher.cli:main",
                                    "hvd-edl-ctl = launcher.ctl:main",
                                    "hvd-edl-cluster = launcher.cluster.cli:main"]},
)
