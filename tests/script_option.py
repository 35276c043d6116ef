"""`--script COPY`, as a plugin that pytest.ini loads before it parses the command line: so `--script my_ppo.py` (a
path after a space) is read as the option's value, not as a test path (conftest.py acts on it). `pip install -e .`
installs it too, for pytest runs that do not read pytest.ini: pytest takes the path in `--script /elsewhere/copy.py`
for a test path before it knows the option, and looks for its pytest.ini there."""

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--script",
        metavar="COPY",
        help="run the behavioural tests of the CartPole script COPY was copied from (probes, compiled vs eager, "
        "resume vs one run, modifications, learning) against COPY",
    )


def pytest_configure(config):
    """`--script` where the repository's pytest.ini was not read: one line that says how to run it."""
    if (path := config.getoption("--script")) and config.inipath is None:
        raise pytest.UsageError(
            f"--script {path}: run pytest in the repository's folder, writing --script={path} for a copy elsewhere "
            "(pytest takes a path after a space for a test path, and looks for its pytest.ini there)"
        )
