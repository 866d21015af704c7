"""pytest -p pytest_times (bench/ on the path): each test phase's outcome and seconds as it ends,
so that a device run its time limit cuts still shows where the time went."""


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.duration >= 1 or report.outcome != "passed":
        print(f"\n[{report.duration:6.1f} s] {report.when:8} {report.outcome:7} {report.nodeid}", flush=True)
