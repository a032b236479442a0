"""A sweep's space file (hvdhetero/sweep/space.py): what a user writes, what the script is given,
and every way the file can be wrong, each refused with the file, the line and the key before any
trial starts."""

from __future__ import annotations

import argparse
import ast
import itertools

import pytest

from hvdhetero.errors import SpaceError
from hvdhetero.sweep import space

GOOD = """\
# what my_train.py takes
lr: {loguniform: [1.0e-4, 1.0e-1]}
dropout:
  uniform: [0.0, 0.5]
  step: 0.1
hidden: {int: [32, 256], step: 32}
layers: {int: [1, 64], log: true}
optimizer: {choice: [adam, sgd, 0.5, true]}
"""


def write(tmp_path, text, name="space.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_space_is_read_in_file_order_and_gives_the_script_its_arguments(tmp_path):
    loaded = space.load(write(tmp_path, GOOD))
    assert [(p.name, p.kind, p.line) for p in loaded.params] == [
        ("lr", "loguniform", 2), ("dropout", "uniform", 3), ("hidden", "int", 6), ("layers", "int", 7),
        ("optimizer", "choice", 8)]
    lr, dropout, hidden, layers, optimizer = loaded.params
    assert (lr.low, lr.high, lr.step, lr.log) == (1e-4, 0.1, None, False)
    assert (dropout.low, dropout.high, dropout.step) == (0.0, 0.5, 0.1)
    assert (hidden.low, hidden.high, hidden.step) == (32, 256, 32) and type(hidden.low) is int
    assert layers.log and optimizer.choices == ("adam", "sgd", 0.5, True)
    values = {"lr": 0.0031622776601683794, "dropout": 0.2, "hidden": 96, "layers": 8, "optimizer": True}
    assert loaded.argv(values) == ["--lr=0.0031622776601683794", "--dropout=0.2", "--hidden=96", "--layers=8",
                                   "--optimizer=True"]
    parser = argparse.ArgumentParser()  # the script reads back exactly the value tried: argparse's...
    for name, kind in (("lr", float), ("dropout", float), ("hidden", int), ("layers", int), ("optimizer", str)):
        parser.add_argument(f"--{name}", type=kind)
    assert vars(parser.parse_args(loaded.argv(values))) == {**values, "optimizer": "True"}
    read = {}  # ...and nanoGPT's configurator, which takes only --key=value
    for arg in loaded.argv(values):
        key, val = arg[2:].split("=")
        read[key] = ast.literal_eval(val)
    assert read == values  # (True, as nanoGPT's `compile = True` global takes it)


def test_a_flag_is_passed_alone_or_not_at_all_as_argparses_store_true_reads_it(tmp_path):
    loaded = space.load(write(tmp_path, "use_bn: {choice: [true, false], flag: true}\ncompile: {choice: [true, false]}\n"))
    assert loaded.argv({"use_bn": True, "compile": False}) == ["--use_bn", "--compile=False"]
    assert loaded.argv({"use_bn": False, "compile": True}) == ["--compile=True"]
    parser = argparse.ArgumentParser()
    parser.add_argument("--use_bn", action="store_true")
    parser.add_argument("--compile", type=ast.literal_eval)
    for use_bn in (True, False):
        assert vars(parser.parse_args(loaded.argv({"use_bn": use_bn, "compile": False}))) == {
            "use_bn": use_bn, "compile": False}
    with pytest.raises(SystemExit):  # what a flag written as a value got: "ignored explicit argument 'True'"
        parser.parse_args(["--use_bn=True"])


def test_a_flag_on_by_default_is_passed_as_argparses_boolean_optional_action_reads_it(tmp_path):
    """`--amp` or `--no-amp`: a flag that is on unless turned off, where passing nothing for
    false would run every false trial with it on, recorded as off."""
    path = write(tmp_path, "amp: {choice: [true, false], flag: both}\nuse_bn: {choice: [true, false], flag: true}\n")
    loaded = space.load(path)
    parser = argparse.ArgumentParser()
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--use_bn", action="store_true")
    for amp, use_bn in itertools.product((True, False), repeat=2):
        assert vars(parser.parse_args(loaded.argv({"amp": amp, "use_bn": use_bn}))) == {"amp": amp, "use_bn": use_bn}
    assert loaded.argv({"amp": False, "use_bn": False}) == ["--no-amp"]
    # a store_true flag written as both: its argparse has no --no-NAME
    said = "error: rank 0 on host pc failed: SystemExit: 2: train.py: error: unrecognized arguments: --no-amp"
    assert loaded.hint(said) == (
        f"; the script has no --no-amp: --amp is a flag that is off unless given (argparse's store_true): write "
        f"`flag: true` for amp in {path} (line 1), and each trial passes --amp or nothing")


def test_a_hydra_app_gets_its_values_as_overrides_and_a_key_its_config_lacks_is_named(tmp_path):
    """A script with `@hydra.main` reads `optimizer.lr=0.01 optimizer=adam` (no dashes; a flag
    as true or false); the sweep's budget too (`epochs=1`). Hydra's refusal of a key its config
    lacks names the space's line; an app whose @hydra.main is in another file is told to sweep
    that file."""
    path = write(tmp_path, "optimizer: {choice: [sgd, adam]}\noptimizer.lr: {loguniform: [0.001, 0.1]}\n"
                           "amp: {choice: [true, false], flag: true}\n")
    app = tmp_path / "train.py"
    app.write_text("import hydra\nfrom omegaconf import DictConfig\n\n\n"
                   "@hydra.main(version_base=None, config_path='conf', config_name='config')\ndef main(cfg): ...\n")
    loaded = space.load(path, str(app))
    assert loaded.overrides and loaded.argv({"optimizer": "adam", "optimizer.lr": 0.01, "amp": False}) == [
        "optimizer=adam", "optimizer.lr=0.01", "amp=False"]
    assert loaded.option("epochs", 1) == "epochs=1" and space.load(path).option("epochs", 1) == "--epochs=1"
    said = ("error: rank 0 on host pc failed: ConfigCompositionException: Could not override 'optimizer.lr'.\n"
            "To append to your config use +optimizer.lr=0.01")
    assert loaded.hint(said) == (f"; the script's config has no key optimizer.lr: name optimizer.lr in {path} (line 2) "
                                 "as in its config (--cfg job prints it), or +optimizer.lr to add it")
    said = ("error: rank 0 on host pc failed: MissingConfigException: In 'config': Could not find "
            "'optimizer/adamw'")
    assert loaded.hint(said) == (f"; the script's config group optimizer has no option adamw: give optimizer in {path} "
                                 "(line 1) only the group's options (the files of its optimizer/ folder)")
    assert loaded.hint("error: rank 0 on host pc failed: ConfigCompositionException: Could not override "
                       "'epochs'.").startswith("; the script's config has no key epochs, which --budget sets")
    # a string its grammar would read as something else is quoted
    words = space.load(write(tmp_path, "name: {choice: ['a,b', '1e-3', 'null', resnet-50]}\n", "words.yaml"), str(app))
    assert [words.argv({"name": v})[0] for v in words.params[0].choices] == [
        "name='a,b'", "name='1e-3'", "name='null'", "name=resnet-50"]
    for imported, decorated in (("import hydra as hy", "@hy.main(config_path=None)"), ("import os, hydra", "@hydra.main()"),
                                ("from hydra import main", "@main(config_path=None)"),
                                ("from hydra import compose, main as hm", "@hm()")):
        app.write_text(f"{imported}\n\n\n{decorated}\ndef run(cfg): ...\n")
        assert space.load(path, str(app)).overrides, (imported, decorated)
    app.write_text("import hydra\n\n\n@main(x)\ndef run(cfg): ...\n")  # a decorator of its own named main
    assert not space.load(path, str(app)).overrides
    plain = tmp_path / "launch.py"
    plain.write_text("from app.train import main  # its @hydra.main is there\n\nmain()\n")
    other = space.load(path, str(plain))
    assert not other.overrides and other.argv({"optimizer": "sgd", "optimizer.lr": 0.01, "amp": True}) == [
        "--optimizer=sgd", "--optimizer.lr=0.01", "--amp"]
    usage = ("error: rank 0 on host pc failed: SystemExit: 2: launch.py: error: unrecognized arguments: "
             "--optimizer=sgd (usage: launch.py [overrides ...])")  # as the rank says it (rank/runner.py)
    assert other.hint(usage).startswith(
        f"; the script is a Hydra app (its usage ends in [overrides ...]), which takes key=value without dashes, but no "
        f"@hydra.main was recognised in {plain}: sweep the file that has it (--script)")


def test_a_trials_argparse_error_over_a_parameter_says_what_to_write_in_the_space(tmp_path):
    path = write(tmp_path, "lr: {loguniform: [0.01, 0.1]}\nuse_bn: {choice: [true, false]}\n")
    loaded = space.load(path)
    said = "error: rank 0 on host pc failed: SystemExit: 2: train.py: error: "
    assert loaded.hint(said + "argument --use_bn: ignored explicit argument 'False'") == (
        f"; --use_bn is a flag, which takes no value: write `use_bn: {{choice: [true, false], flag: true}}` in {path} "
        "(line 2), and each trial passes --use_bn or nothing")
    assert loaded.hint(said + "unrecognized arguments: --lr=0.05") == (
        f"; the script has no option --lr: name lr in {path} (line 1) as the script's own option (its --help lists "
        "them)")
    assert loaded.hint(said + "unrecognized arguments: --lr_decay=0.5") == ""  # not the space's
    assert loaded.hint(said + "argument -b/--use_bn: ignored explicit argument 'True'").startswith(
        "; --use_bn is a flag, which takes no value")
    assert loaded.hint(said + "argument --use_bn: invalid choice: 'True' (choose from 'yes', 'no')") == (
        f"; the script refuses a value of use_bn (invalid choice: 'True' (choose from 'yes', 'no')): give use_bn in "
        f"{path} (line 2) only values the script takes")
    assert loaded.hint(said + "ambiguous option: --lr=0.05 could match --lr_decay, --lr_warmup").startswith(
        "; the script has no option --lr: name lr")
    assert loaded.hint(said + "argument --lr_decay: invalid float value: 'x'") == ""  # not the space's
    assert loaded.hint("error: rank 0 on host pc failed: ValueError: nan") == ""


def test_a_dotted_name_is_a_nested_settings_option_as_mingpts_configurator_reads_it(tmp_path):
    loaded = space.load(write(tmp_path, "trainer.learning_rate: {loguniform: [1.0e-4, 1.0e-2]}\n"))
    assert loaded.argv({"trainer.learning_rate": 0.0003}) == ["--trainer.learning_rate=0.0003"]


def test_the_space_becomes_optunas_distributions_and_trials_ask_within_it(tmp_path):
    optuna = pytest.importorskip("optuna", reason="optuna is in the launcher extra (ci/setup installs it)")
    loaded = space.load(write(tmp_path, GOOD))
    dists = loaded.distributions()
    assert dists["lr"] == optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)
    assert dists["dropout"] == optuna.distributions.FloatDistribution(0.0, 0.5, step=0.1)
    assert dists["hidden"] == optuna.distributions.IntDistribution(32, 256, step=32)
    assert dists["layers"] == optuna.distributions.IntDistribution(1, 64, log=True)
    assert dists["optimizer"] == optuna.distributions.CategoricalDistribution(("adam", "sgd", 0.5, True))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask(dists)
        p = trial.params
        assert 1e-4 <= p["lr"] <= 0.1 and p["hidden"] % 32 == 0 and p["optimizer"] in ("adam", "sgd", 0.5, True)
        assert len(loaded.argv(p)) == 5
        study.tell(trial, p["lr"])


BAD = {  # id: (text, line, key, what the message must say)
    "a list, not a mapping": ("- lr\n- dropout\n", 1, "(top level)", "must be a mapping of parameter names"),
    "empty mapping": ("{}\n", 1, "(top level)", "names no parameter"),
    "not YAML": ("lr: {loguniform: [1, 2]\n", 2, "(top level)", "not valid YAML"),
    "name with a space": ("'learning rate': {uniform: [0, 1]}\n", 1, "learning rate", "becomes the script's option"),
    "name with a dot at its end": ("trainer.: {uniform: [0, 1]}\n", 1, "trainer.", "dotted for a nested setting"),
    "parameter twice": ("lr: {uniform: [0, 1]}\nlr: {uniform: [0, 2]}\n", 2, "lr", "'lr' is set twice"),
    "a number, not a distribution": ("lr: 0.1\n", 1, "lr", "must be a mapping of one distribution"),
    "no distribution": ("lr: {step: 0.1}\n", 1, "lr", "needs exactly one distribution of uniform, loguniform, "
                                                      "int, choice; it names none"),
    "two distributions": ("lr: {uniform: [0, 1], loguniform: [0.1, 1]}\n", 1, "lr", "it names uniform and loguniform"),
    "misspelt distribution": ("lr: {logunifrom: [0.1, 1]}\n", 1, "lr.logunifrom", "did you mean 'loguniform'"),
    "optuna's float": ("lr:\n  float: [1.0e-5, 0.1]\n  log: true\n", 2, "lr", "'float' is Optuna's name: write "
                       "uniform: [low, high] (loguniform: [low, high] where Optuna's suggest_float had log=True"),
    "a condition on a later parameter": ("a: {int: [1, 3], when: {b: [1]}}\nb: {int: [1, 3]}\n", 1, "a.when.b",
                                         "'b' is no parameter above a in the file"),
    "a condition's value no choice": ("o: {choice: [adam, sgd]}\nm: {uniform: [0, 1], when: {o: [sgdm]}}\n", 2,
                                      "m.when.o", "sgdm is none of o's choices (adam, sgd)"),
    "a range on a choice": ("o: {choice: [adam, sgd]}\nm: {uniform: [0, 1], when: {o: {min: 1}}}\n", 2, "m.when.o",
                            "o is a choice: list the values in which m is tried, e.g. [adam]"),
    "values of a float": ("d: {uniform: [0, 1]}\nm: {uniform: [0, 1], when: {d: [0.5]}}\n", 2, "m.when.d",
                          "d is a number in a range: give the range, {min: .., max: ..}"),
    "an empty condition": ("n: {int: [1, 3]}\nm: {uniform: [0, 1], when: {n: {}}}\n", 2, "m.when.n",
                           "give min, max or both"),
    "optuna's categorical": ("opt: {categorical: [adam, sgd]}\n", 1, "opt", "write choice: [values]"),
    "one bound": ("lr: {uniform: [0.1]}\n", 1, "lr.uniform", "must be a list of two numbers, [low, high], got 1 values"),
    "bounds reversed": ("lr: {uniform: [1, 0.1]}\n", 1, "lr.uniform", "low must be below high, got [1.0, 0.1]"),
    "bound not a number": ("lr: {uniform: [0, high]}\n", 1, "lr.uniform", "got 'high' (a string)"),
    "log scale from 0": ("lr: {loguniform: [0, 1]}\n", 1, "lr.loguniform", "a log scale needs low > 0, got 0.0"),
    "int with a float bound": ("n: {int: [1, 2.5]}\n", 1, "n.int", "must be integer (low and high are integers), "
                                                                   "got '2.5' (a number)"),
    "int step 0": ("n: {int: [1, 9], step: 0}\n", 1, "n.step", "must be an integer >= 1, got '0'"),
    "step larger than the range": ("x: {uniform: [0, 1], step: 2}\n", 1, "x.step", "is larger than the range"),
    "log and step": ("n: {int: [1, 64], log: true, step: 2}\n", 1, "n.step", "log and step do not go together"),
    "log on uniform": ("x: {uniform: [0.1, 1], log: true}\n", 1, "x.log", "for a log scale use loguniform"),
    "log not a boolean": ("n: {int: [1, 64], log: yes please}\n", 1, "n.log", "must be true or false"),
    "step on a choice": ("o: {choice: [a, b], step: 1}\n", 1, "o.step", "choice takes flag besides its values"),
    "flag on a choice of words": ("o: {choice: [a, b], flag: true}\n", 1, "o.flag", "a flag (--NAME or nothing) is a "
                                  "choice of true and false; o lists a, b"),
    "flag on a range": ("x: {uniform: [0, 1], flag: true}\n", 1, "x.flag", "uniform takes step besides its range"),
    "flag not a boolean": ("o: {choice: [true, false], flag: 1}\n", 1, "o.flag", "must be true (--o or nothing), "
                           "false or both (--o or --no-o, argparse's BooleanOptionalAction), got '1' (an integer)"),
    "flag of another word": ("o: {choice: [true, false], flag: negated}\n", 1, "o.flag", "must be true (--o or "
                             "nothing), false or both (--o or --no-o, argparse's BooleanOptionalAction), got 'negated'"),
    "empty choice": ("o: {choice: []}\n", 1, "o.choice", "must be a non-empty list of values"),
    "choice twice": ("o:\n  choice:\n    - adam\n    - sgd\n    - adam\n", 5, "o.choice",
                     "'adam' is listed twice (first on line 3)"),
    "choice of a list": ("o: {choice: [[1, 2], 3]}\n", 1, "o.choice", "must be a plain value"),
}


CONDITIONAL = """\
n_layers: {int: [1, 3]}
n_units_l0: {int: [4, 128], log: true}
n_units_l1: {int: [4, 128], log: true, when: {n_layers: {min: 2}}}
n_units_l2: {int: [4, 128], log: true, when: {n_layers: [3]}}
optimizer: {choice: [Adam, RMSprop, SGD]}
momentum: {uniform: [0.0, 0.99], when: {optimizer: [SGD], n_layers: {max: 2}}}
"""


def test_a_parameter_that_applies_only_to_some_values_of_earlier_ones_is_tried_and_passed_only_there(tmp_path):
    """Optuna's examples' conditional space (`for i in range(n_layers): trial.suggest_int(f"n_units_l{i}",
    ...)`): a parameter with `when:` is asked in the file's order where its conditions hold on the
    values before it, and a trial passes only the ones it tried (the script's default stands for the
    rest); the study holds no value a trial left unused (a flat space sampled every layer's units
    for a 1-layer net, and the importances ranked an unused one first)."""
    optuna = pytest.importorskip("optuna", reason="optuna is in the launcher extra (ci/setup installs it)")
    loaded = space.load(write(tmp_path, CONDITIONAL))
    assert loaded.params[2].when == (("n_layers", None, 2, None),)
    assert loaded.params[5].when == (("optimizer", ("SGD",), None, None), ("n_layers", None, None, 2))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    seen = set()
    for _ in range(40):
        trial = loaded.ask(study)
        p = trial.params
        assert ("n_units_l1" in p) == (p["n_layers"] >= 2) and ("n_units_l2" in p) == (p["n_layers"] == 3), p
        assert ("momentum" in p) == (p["optimizer"] == "SGD" and p["n_layers"] <= 2), p
        assert loaded.argv(p) == [f"--{k}={space.format_value(v)}" for k, v in
                                  sorted(p.items(), key=lambda kv: [q.name for q in loaded.params].index(kv[0]))]
        seen.add((p["n_layers"], "momentum" in p))
        study.tell(trial, p["n_units_l0"])
    assert {(1, True), (3, False)} <= seen and len({n for n, _ in seen}) == 3, seen


def test_the_checks_before_a_sweep_try_a_conditional_parameter_only_where_it_applies(tmp_path):
    """From a review: the extremes a sweep checks first passed every parameter (units_l2 with one
    layer, momentum with Adam), which the built-in recipe's check could refuse though no trial
    would pass them; a conditional parameter's ends are tried with its conditions met."""
    from hvdhetero.sweep.request import extremes

    tried = extremes(space.load(write(tmp_path, CONDITIONAL)))
    for values in tried:
        assert ("n_units_l1" in values) == (values["n_layers"] >= 2), values
        assert ("n_units_l2" in values) == (values["n_layers"] == 3), values
        assert ("momentum" in values) == (values["optimizer"] == "SGD" and values["n_layers"] <= 2), values
    assert {values.get("n_units_l2") for values in tried} >= {4, 128}
    assert {values.get("momentum") for values in tried} >= {0.0, 0.99}


@pytest.mark.parametrize("text, line, key, said", BAD.values(), ids=BAD.keys())
def test_a_bad_space_file_is_refused_naming_the_file_line_and_key(tmp_path, text, line, key, said):
    path = write(tmp_path, text)
    with pytest.raises(SpaceError) as refused:
        space.load(path)
    err = refused.value
    assert (err.path, err.line, err.key) == (str(path), line, key), str(err)
    assert said in err.problem, str(err)
    named = "" if key == "(top level)" else f"key '{key}': "  # the file as a whole: no key named
    assert str(err).startswith(f"{path}:{line}: {named}") and "(top level)" not in str(err) and err.exit_code == 2, \
        str(err)


def test_a_missing_or_empty_space_file_says_what_to_write(tmp_path):
    with pytest.raises(SpaceError, match=r"file not found; write one, e\.g\. lr: \{loguniform"):
        space.load(tmp_path / "nope.yaml")
    with pytest.raises(SpaceError, match="the file is empty; it needs at least one parameter"):
        space.load(write(tmp_path, "# nothing yet\n"))
