"""The report page in a real browser (headless Chromium): the charts render, and the page
asks the network for nothing. Skipped, with the reason, where no Chromium is installed
(`.ci/run` installs Debian's `chromium`)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from profiles_factory import uniform_chain

from memplan.plan import plan_to_yaml
from memplan.profile import profile_to_yaml
from memplan.report import build_report, write_report
from memplan.solver import SolveRequest, solve

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
BROWSER = next((path for name in BROWSERS if (path := shutil.which(name))), None)
pytestmark = pytest.mark.skipif(
    BROWSER is None,
    reason="no Chromium on PATH (apt-get install chromium; .ci/run installs it)",
)
# Chromium's own background services (component updates, time, sign-in), which it calls
# whatever page is open; anything else reaching the proxy came from the page.
BROWSER_SERVICES = ("google.com", "googleapis.com", "gvt1.com", "gstatic.com")


class RecordingProxy:
    """A proxy on 127.0.0.1 that answers nothing and remembers every request line."""

    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(32)
        self.port = self.server.getsockname()[1]
        self.requests: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    first = conn.recv(4096).split(b"\r\n", 1)[0]
                except OSError:
                    first = b"?"
                self.requests.append(first.decode("latin-1"))

    def page_requests(self) -> list[str]:
        return [r for r in self.requests if not any(host in r for host in BROWSER_SERVICES)]

    def close(self) -> None:
        self.server.close()


def chromium(*args: str, proxy: RecordingProxy, home: Path) -> subprocess.CompletedProcess:
    command = [
        BROWSER,
        "--headless",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-default-apps",
        "--disable-sync",
        f"--user-data-dir={home}",
        f"--proxy-server=127.0.0.1:{proxy.port}",
        "--proxy-bypass-list=<-loopback>",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("browser")
    profile = uniform_chain(6, saved=[100, 400, 100, 400, 100, 100]).profile()
    (folder / "m.profile.yaml").write_text(profile_to_yaml(profile))
    plan = solve(
        profile,
        SolveRequest(target_batch=64, budget_bytes=29_750, profile_path="m.profile.yaml"),
    ).plan
    (folder / "m.plan.yaml").write_text(plan_to_yaml(plan))
    out = folder / "report.html"
    write_report(build_report(folder / "m.plan.yaml"), out)
    return out


def test_charts_render_and_nothing_is_fetched(page, tmp_path):
    from matplotlib.image import imread

    proxy = RecordingProxy()
    try:
        shot = tmp_path / "shot.png"
        run = chromium(
            "--window-size=1280,1600",
            f"--screenshot={shot}",
            page.as_uri(),
            proxy=proxy,
            home=tmp_path / "home1",
        )
        assert shot.is_file(), run.stderr[-2000:]
        dom = chromium("--dump-dom", page.as_uri(), proxy=proxy, home=tmp_path / "home2")
        assert dom.returncode == 0, dom.stderr[-2000:]
    finally:
        proxy.close()

    pixels = imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (1600, 1280)
    coloured = (pixels.max(axis=-1) - pixels.min(axis=-1) > 0.2).mean()
    non_white = (pixels.min(axis=-1) < 0.9).mean()
    # The stacked timeline alone colours a large block of the first screen.
    assert coloured > 0.05 and non_white > 0.1, (coloured, non_white)

    html = dom.stdout
    for element in ('id="timeline-chart"', 'id="candidates-chart"', 'id="layers"'):
        assert element in html
    assert html.count("<svg") == 2
    assert html.count("<tr") == 1 + 6  # header and one row per layer
    assert "Failed to load resource" not in dom.stderr + run.stderr
    assert proxy.page_requests() == []
