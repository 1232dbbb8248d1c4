"""The docs runner itself: which blocks it finds, the norun convention, and how it runs a block
(exit status, time limit, background processes stopped, top-level await)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from tests.docs.blocks import doc_files, parse_blocks, runnable_blocks
from tests.docs.test_doc_blocks import ROOT, DocsGateway, block_env, run_block, workdir

PAGE = """# A page

```bash
echo one
```

<!-- norun: needs a GPU -->

```python
import torch
```

- a list item:

    ~~~sh
    echo indented
    ~~~

<!-- norun -->
```bash
echo no reason
```

```json
{"not": "run"}
```

````python title="x.py"
print("``` inside")
````
"""


def test_blocks_languages_lines_and_norun(tmp_path: Path) -> None:
    path = tmp_path / "page.md"
    path.write_text(PAGE)
    blocks = parse_blocks(path)
    assert [(b.line, b.lang, b.kind) for b in blocks] == [
        (3, "bash", "bash"), (9, "python", "python"), (15, "sh", "bash"), (20, "bash", "bash"),
        (24, "json", None), (28, "python", "python")]
    assert [b.norun for b in blocks] == [None, "needs a GPU", None, "", None, None]
    assert blocks[2].code == "echo indented\n"
    assert blocks[5].code == 'print("``` inside")\n'
    assert blocks[0].test_id(tmp_path) == "page.md:3"


def test_every_page_under_docs_is_picked_up(tmp_path: Path) -> None:
    (tmp_path / "docs" / "new" / "deeper").mkdir(parents=True)
    (tmp_path / "README.md").write_text("```bash\ntrue\n```\n")
    (tmp_path / "docs" / "new" / "deeper" / "page.md").write_text("```python\npass\n```\n")
    (tmp_path / "docs" / "notes.txt").write_text("```bash\nfalse\n```\n")
    assert [p.relative_to(tmp_path).as_posix() for p in doc_files(tmp_path)] == [
        "README.md", "docs/new/deeper/page.md"]
    assert [b.test_id(tmp_path) for b in runnable_blocks(tmp_path)] == [
        "README.md:1", "docs/new/deeper/page.md:1"]
    # the repository's own docs: every norun marker has its reason
    assert all(b.norun != "" for b in runnable_blocks(ROOT))


def _run(tmp_path: Path, kind: str, code: str, timeout_s: float = 30.0) -> tuple[int | None, str]:
    from tests.docs.blocks import Block

    block = Block(tmp_path / "x.md", 1, kind, code)
    env = block_env(DocsGateway("http://127.0.0.1:9", "k" * 20))
    cwd = Path(tempfile.mkdtemp(dir=tmp_path))
    return run_block(block, env, workdir(cwd), timeout_s)


def test_a_failing_command_fails_the_block_under_pipefail(tmp_path: Path) -> None:
    code, _ = _run(tmp_path, "bash", "false | true\necho after\n")
    assert code != 0
    code, out = _run(tmp_path, "bash", 'echo "$UNSET_VARIABLE"\n')
    assert code != 0 and "unbound variable" in out


def test_the_block_sees_the_repository_layout_and_the_environment(tmp_path: Path) -> None:
    code, out = _run(tmp_path, "bash", 'test -f examples/any_agent/serve.yaml\n'
                     'echo "$GATEWAY_URL $OPENAI_BASE_URL $ROLLOUT_SERVER_PORT"\n'
                     'test -z "${RELAYRL_URL:-}"\n'
                     'command -v relayrl\n')
    assert code == 0, out
    url, base, port = out.split("\n")[0].split()
    assert url == base == "http://127.0.0.1:9" and port.isdigit()


def test_a_block_past_its_time_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "bg.pid"
    start = time.monotonic()
    code, _ = _run(tmp_path, "bash", f"sleep 300 &\necho $! > {pid_file}\nsleep 300\n",
                   timeout_s=2)
    assert code is None and time.monotonic() - start < 30
    pid = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the block's background process outlived it")


def test_python_blocks_may_await_at_top_level(tmp_path: Path) -> None:
    code, out = _run(tmp_path, "python", "import asyncio\nawait asyncio.sleep(0)\n"
                     "print('awaited', __name__)\n")
    assert code == 0 and "awaited __main__" in out, out
    code, out = _run(tmp_path, "python", "raise SystemExit(3)\n")
    assert code == 3
