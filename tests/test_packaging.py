"""The wheel is the package and nothing else (issue 54): the offline toy task that the examples, the demo and the tests
train on is examples/toy.py, no module of the package, and the CLI recipe names its reward functions there.
scripts/check_package.sh builds the wheel and checks what it holds; these check the tree it is built from."""

import importlib
import importlib.machinery
import tomllib
from pathlib import Path

import yaml

import unsloth_adaptive_kl

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(unsloth_adaptive_kl.__file__).resolve().parent


def test_the_toy_task_is_no_module_of_the_package():
    assert not (PACKAGE / "toy.py").exists()
    # Looked up in the package's own folders (an editable install of another checkout adds a finder of its own).
    assert importlib.machinery.PathFinder.find_spec("unsloth_adaptive_kl.toy", unsloth_adaptive_kl.__path__) is None
    assert not hasattr(unsloth_adaptive_kl, "toy")


def test_the_wheel_is_built_from_the_package_folder_alone():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["include"] == ["unsloth_adaptive_kl*"]
    assert not {"py-modules", "package-data", "data-files"} & set(setuptools)


def test_the_recipes_reward_functions_are_the_examples_toy_task_imported_from_the_repository_root(monkeypatch):
    """TRL's grpo script imports each dotted path with the working directory on sys.path: from the repository's root
    (where the README runs the recipe), examples.toy is examples/toy.py."""
    recipe = yaml.safe_load((ROOT / "examples" / "grpo_recipe.yaml").read_text())
    monkeypatch.syspath_prepend(str(ROOT))
    assert recipe["reward_funcs"] == ["examples.toy.format_reward", "examples.toy.correctness_reward"]
    for dotted in recipe["reward_funcs"]:
        module_name, name = dotted.rsplit(".", 1)
        module = importlib.import_module(module_name)
        assert Path(module.__file__).resolve() == ROOT / "examples" / "toy.py"
        assert callable(getattr(module, name))
    toy = importlib.import_module("examples.toy")  # the rewards the recipe trains with: 0.5 each, as documented there
    assert toy.format_reward(["7", " 12 ", "7 apples"]) == [0.5, 0.5, 0.0]
    assert toy.correctness_reward(["7", "12", "x"], answer=["7", "13", "1"]) == [0.5, 0.0, 0.0]
