"""Issue 14, "a newcomer's first hour": bound methods, refused targets, pickling and
copying, TorchScript, stats of a decorated forward, option checks, save_plan errors."""

import copy
import pickle

import pytest
import torch
from torch import nn

import autograph

pytestmark = pytest.mark.usefixtures("standin")


@autograph.graphed
def double(x):
    return x * 2


def plus_one(x, y=None):
    return x + 1


class NewcomerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @autograph.graphed(warmup=0)
    def forward(self, x):
        return self.fc(x).relu()


class Scaler:
    def __init__(self, k: float) -> None:
        self.k = k

    def scale(self, x):
        return x * self.k


# -- bound methods ----------------------------------------------------------------------
def test_bound_forward_of_a_module_is_graphed_with_its_parameters_watched():
    lin = nn.Linear(4, 4)
    step = autograph.graphed(lin.forward, warmup=0)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(step(x), lin(x))
        s = autograph.stats(step)
        assert (s["captures"], s["replays"]) == (1, 2)
        lin.weight = nn.Parameter(torch.randn(4, 4))  # a replaced parameter is seen
        torch.testing.assert_close(step(x), nn.functional.linear(x, lin.weight, lin.bias))
    assert autograph.stats(step)["invalidations"] >= 1
    step.reset()
    assert autograph.stats(step)["graphs"] == 0


def test_bound_method_of_a_plain_object():
    s = Scaler(3.0)
    step = autograph.graphed(s.scale, warmup=0)
    x = torch.randn(5)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(step(x), x * 3)
    assert autograph.stats(step)["replays"] == 2
    assert autograph.warmup(step, x)  # the engine of the bound method is found
    assert step.__self__ is s and step.__name__ == "scale"


def test_bound_method_options_are_checked_against_its_signature():
    with pytest.raises(ValueError, match=r"'x'.*parameters are: input"):
        autograph.graphed(nn.Linear(2, 2).forward, batch_dims={"x": 0})


# -- what cannot be graphed -------------------------------------------------------------
def test_a_class_is_refused_with_what_to_do():
    pattern = r"cannot graph a class \(NewcomerNet\).*graphed\(NewcomerNet\(\.\.\.\)\)"
    with pytest.raises(TypeError, match=pattern):
        autograph.graphed(NewcomerNet)
    with pytest.raises(TypeError, match="cannot graph a class"):
        autograph.graphed(warmup=1)(Scaler)


def test_generator_and_async_functions_are_refused():
    def gen(x):
        yield x

    async def coro(x):
        return x

    async def agen(x):
        yield x

    for fn, kind in ((gen, "a generator function"), (coro, "an async function"),
                     (agen, "an async generator function")):
        with pytest.raises(TypeError, match=f"cannot graph {kind}.*graph the ordinary"):
            autograph.graphed(fn)
    with pytest.raises(TypeError, match="generator"):
        autograph.graphed(staticmethod(gen))


def test_module_whose_forward_is_decorated_is_refused():
    net = NewcomerNet()
    with pytest.raises(TypeError, match="NewcomerNet.forward is already decorated"):
        autograph.graphed(net)
    with pytest.raises(TypeError, match="already graphed"):
        autograph.graphed(net.forward)


# -- pickling and copying ---------------------------------------------------------------
def test_graphed_module_level_function_pickles_by_reference():
    assert pickle.loads(pickle.dumps(double)) is double
    assert copy.copy(double) is double and copy.deepcopy(double) is double


def test_graphed_function_pickles_and_copies_as_a_working_graphed_function():
    g = autograph.graphed(plus_one, warmup=0, max_graphs=3)
    p = pickle.loads(pickle.dumps(g))
    assert type(p) is type(g) and p is not g
    assert p.__wrapped__ is plus_one
    x = torch.randn(3)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(p(x), x + 1)
    assert autograph.stats(p)["captures"] == 1
    assert copy.deepcopy(g) is g  # like the function itself


def test_graphed_bound_method_deep_copies_its_instance():
    lin = nn.Linear(3, 3)
    g = autograph.graphed(lin.forward, warmup=0)
    c = copy.deepcopy(g)
    assert c is not g and c.__self__ is not lin
    assert torch.equal(c.__self__.weight, lin.weight)
    x = torch.randn(2, 3)
    with torch.no_grad():
        torch.testing.assert_close(c(x), g(x))
    p = pickle.loads(pickle.dumps(g))
    with torch.no_grad():
        torch.testing.assert_close(p(x), g(x))


def test_module_with_decorated_forward_and_its_bound_forward_pickle():
    net = NewcomerNet()
    p = pickle.loads(pickle.dumps(net))
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(p(x), net(x))
    fwd = pickle.loads(pickle.dumps(net.forward))
    with torch.no_grad():
        torch.testing.assert_close(fwd(x), net(x))


# -- TorchScript ------------------------------------------------------------------------
def test_torch_jit_script_says_what_to_do():
    lin = nn.Linear(2, 2)
    for obj, what in ((autograph.graphed(lin), "module"),
                      (autograph.graphed(plus_one), "function"),
                      (NewcomerNet(), "forward")):
        with pytest.raises(TypeError, match=f"cannot script a graphed {what}.*__wrapped__"):
            torch.jit.script(obj)
    torch.jit.script(lin)  # the original still scripts


# -- stats, reset and report of a decorated forward --------------------------------------
def test_stats_reset_report_accept_a_bound_decorated_forward(capsys):
    net, other = NewcomerNet(), NewcomerNet()
    assert autograph.stats(net.forward)["calls"] == 0  # not called yet
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            net(x)
        other(x)
    s = autograph.stats(net.forward)
    assert (s["calls"], s["captures"], s["replays"]) == (3, 1, 2)
    assert autograph.stats(net.forward) == autograph.stats(net)
    autograph.report(net.forward)
    assert "NewcomerNet.forward" in capsys.readouterr().out
    autograph.reset(net.forward)
    assert autograph.stats(net.forward)["graphs"] == 0
    assert autograph.stats(other.forward)["graphs"] == 1  # only that instance's graphs
    other.forward.reset()
    assert autograph.stats(other)["graphs"] == 0
    with torch.no_grad():
        net(x)
        other(x)
    assert autograph.stats(NewcomerNet.forward)["graphs"] == 2  # on the class: every instance's
    NewcomerNet.forward.reset()
    assert autograph.stats(net)["graphs"] == autograph.stats(other)["graphs"] == 0


# -- options -----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0.5, 0.99])
def test_min_speedup_below_one_is_refused_with_why(bad):
    with pytest.raises(ValueError, match=r"min_speedup must be >= 1.*slower than eager"):
        autograph.graphed(min_speedup=bad)
    autograph.graphed(min_speedup=1)


def test_batch_dims_and_pad_values_name_real_arguments():
    with pytest.raises(ValueError, match=r"batch_dims names 'nosuch'.*plus_one.*x, y"):
        autograph.graphed(plus_one, batch_dims={"nosuch": 0})
    with pytest.raises(ValueError, match=r"pad_values names 'y'.*Linear.forward.*input"):
        autograph.graphed(nn.Linear(2, 2), pad_values={"y": 1})
    with pytest.raises(ValueError, match=r"position 2.*2 positional"):
        autograph.graphed(plus_one, batch_dims={2: 0})
    with pytest.raises(ValueError, match=r"'z'"):
        autograph.graphed(batch_dims={"z": 0})(plus_one)
    # names and positions that exist, methods (self not counted), *args and **kwargs
    autograph.graphed(plus_one, batch_dims={"y": None, 1: 0}, pad_values={0: 1})

    class M(nn.Module):
        @autograph.graphed(batch_dims={"x": 0, 0: 0})
        def forward(self, x):
            return x

    with pytest.raises(ValueError, match="position 1"):
        autograph.graphed(batch_dims={1: 0})(M.forward.__wrapped__)

    def star(*args, **kwargs):
        return args

    autograph.graphed(star, batch_dims={"anything": 0, 7: 0})


# -- save_plan ---------------------------------------------------------------------------
def test_save_plan_into_a_missing_folder_names_the_path(tmp_path):
    path = tmp_path / "missing" / "p.json"
    with pytest.raises(FileNotFoundError, match=str(path).replace("\\", "\\\\")) as info:
        autograph.save_plan(path)
    assert ".autograph-plan-" not in str(info.value)
    assert "does not exist" in str(info.value)


# -- types -------------------------------------------------------------------------------
TYPED_USAGE = '''
import torch
from torch import nn

import autograph


@autograph.graphed
def step(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@autograph.graphed(warmup=1)
def scale(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
    return x * k


class NewcomerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @autograph.graphed
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


y: torch.Tensor = step(torch.ones(2))
step.reset()
scale(torch.ones(2), k=3.0).sum()
scale.reset()
net = NewcomerNet()
net.forward(torch.ones(1, 4)).relu()
NewcomerNet.forward.reset()
autograph.reset(net.forward)
model: nn.Linear = autograph.graphed(nn.Linear(2, 2))
bound = autograph.graphed(model.forward)
bound(torch.ones(2)).relu()
bound.reset()
'''


def test_graphed_is_typed_with_reset(tmp_path):
    """The README's ``step.reset()`` type-checks, and a wrong call is caught."""
    pytest.importorskip("mypy")
    import os
    import subprocess
    import sys

    import autograph as package

    (tmp_path / "good.py").write_text(TYPED_USAGE)
    (tmp_path / "bad.py").write_text(TYPED_USAGE + "step('no')\nstep.nosuch()\n")
    root = os.path.dirname(os.path.dirname(package.__file__))
    # mypy in its own process (run in this one, it upset a later torchrun test), and
    # checking this checkout whatever is installed
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", str(tmp_path / "good.py"), str(tmp_path / "bad.py"),
         "--cache-dir", str(tmp_path / "cache"), "--python-version", "3.11",
         "--no-error-summary"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=dict(os.environ, MYPYPATH=root))
    out = proc.stdout
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert not [e for e in errors if "good.py" in e], out + proc.stderr
    bad = [e for e in errors if "bad.py" in e]
    assert len(bad) == 2 and "incompatible type" in bad[0] and "nosuch" in bad[1], out


# -- the README --------------------------------------------------------------------------
README = __import__("pathlib").Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks(text):
    import re

    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_quick_start_runs_as_pasted_and_graphs(capsys):
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1]
    code = _python_blocks(quick)[0]
    namespace: dict = {}
    exec(compile(code, "README quick start", "exec"), namespace)  # noqa: S102
    # the stand-in backend graphs CPU tensors as CUDA would: the report's claim holds
    s = autograph.stats(namespace["model"])
    assert (s["calls"], s["eager"], s["captures"], s["replays"]) == (5, 2, 1, 2)
    assert "Sequential" in capsys.readouterr().out
    concepts = _python_blocks(text.split("## Main concepts", 1)[1])[0]
    exec(compile("import torch\nimport autograph\n" + concepts, "README concepts", "exec"), {})


def test_readme_is_short_and_links_exist():
    text = README.read_text()
    assert len(text.encode()) < 12_500
    assert "pip install -e \".[test]\" && python -m pytest -q" in text
    assert "### Modules" in text
    import re

    for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.(?:md|png))\)", text):
        assert (README.parent / link).exists(), link
    for page in (README.parent / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([\w./-]+\.(?:md|png))\)", page.read_text()):
            assert (page.parent / link).exists(), (page.name, link)


def test_region_options_naming_no_argument_of_the_module_are_refused():
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="nosuch"):
        with torch.no_grad(), autograph.capture_region(batch_dims={"nosuch": 0}):
            model(torch.randn(2, 3))
    assert torch.nn.Module.__call__.__name__ != "_call"  # the region closed cleanly
