from __future__ import annotations

import base64
from typing import List

from forkd import Result, Sandbox


def test_cells_share_state_and_give_values(sbx: Sandbox) -> None:
    assert sbx.run_code("x = 41").error is None
    x = sbx.run_code("print('hi'); x + 1")
    assert (x.text, x.logs.stdout, x.error) == ("42", ["hi\n"], None)


def test_an_exception_is_an_execution_error(sbx: Sandbox) -> None:
    x = sbx.run_code("1 / 0")
    assert x.error is not None
    assert x.error.name == "ZeroDivisionError"
    assert 'File "<cell>", line 1' in x.error.traceback


def test_streamed_cells_and_rich_results(sbx: Sandbox) -> None:
    out: List[str] = []
    results: List[Result] = []
    x = sbx.run_code(
        "import pandas as pd\nprint('a')\npd.DataFrame({'n': [1, 2]})",
        on_stdout=out.append,
        on_result=results.append,
    )
    assert "".join(out) == "a\n"
    assert results and results[0].html and "<table" in results[0].html
    assert x.results == results and x.execution_count > 0


def test_contexts_are_separate_and_reset(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(cwd="/tmp", envs={"K": "v"})
    assert sbx.run_code("import os; (os.getcwd(), os.environ['K'])", context=ctx).text == "('/tmp', 'v')"
    sbx.run_code("y = 1", context=ctx)
    assert sbx.run_code("'y' in globals()").text == "False"
    sbx.reset_code_context(ctx)
    assert sbx.run_code("'y' in globals()", context=ctx).text == "False"
    assert any(c.id == ctx.id for c in sbx.list_code_contexts())
    sbx.remove_code_context(ctx)
    assert all(c.id != ctx.id for c in sbx.list_code_contexts())


def test_a_figure_comes_back_as_png_and_pip_is_there(sbx: Sandbox) -> None:
    x = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nNone", timeout=300)
    assert x.error is None, x.error
    pngs = [r.png for r in x.results if r.png]
    assert pngs, x.results
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")
    assert sbx.commands.run("python3 -m pip --version").exit_code == 0


def test_variables_for_one_run_are_put_back_after_it(sbx: Sandbox) -> None:
    probe = "import os; os.environ.get('RUN_ONLY', 'unset')"
    assert sbx.run_code(probe, envs={"RUN_ONLY": "this run"}).text == "'this run'"
    assert sbx.run_code(probe).text == "'unset'"
    out: List[str] = []
    sbx.run_code("print(os.environ['RUN_ONLY'])", envs={"RUN_ONLY": "streamed"}, on_stdout=out.append)
    assert "".join(out) == "streamed\n" and sbx.run_code(probe).text == "'unset'"
