"""`--script COPY`, as a plugin that pytest.ini loads before it parses the command line: so `--script my_ppo.py` (a
path after a space) is read as the option's value, not as a test path (conftest.py acts on it)."""


def pytest_addoption(parser):
    parser.addoption(
        "--script",
        metavar="COPY",
        help="run the behavioural tests of the CartPole script COPY was copied from (probes, compiled vs eager, "
        "resume vs one run, modifications, learning) against COPY",
    )
