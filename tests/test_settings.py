"""A method's settings are declared once, in its settings class: the check before a model loads, the
defaults the factory gets, conf/method/<name>.yaml and docs/methods.md's settings table follow from it."""

from __future__ import annotations

import importlib.util
from dataclasses import fields

import pytest
from omegaconf import OmegaConf

from methods.base import available_methods, check_method_params, get_method, method_settings
from methods.pld import PLDSettings
from methods.settings.params import ConfigError
from tests.conftest import REPO


def method_configs():
    spec = importlib.util.spec_from_file_location("method_configs", REPO / "scripts" / "method_configs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_yaml_files_and_the_docs_table_are_written_from_the_settings_classes():
    configs = method_configs()
    stale = [str(path.relative_to(REPO)) for path, text in configs.expected_files().items() if path.read_text() != text]
    assert not stale, f"out of date: {stale}; run make docs"
    assert {path.stem for path in (REPO / "conf" / "method").glob("*.yaml")} == set(configs.suite_methods())


@pytest.mark.parametrize("name", [path.stem for path in sorted((REPO / "conf" / "method").glob("*.yaml"))])
def test_every_default_is_valid_and_the_yaml_holds_the_defaults(name):
    settings = method_settings(name)
    for f in fields(settings):
        assert f.metadata["check"](settings.defaults()[f.name]), f"{name}.{f.name}"
        assert f.metadata["doc"] and "\n" not in f.metadata["doc"], f"{name}.{f.name}: one line of documentation"
    config = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "method" / f"{name}.yaml"))
    assert config == {"name": name, **settings.defaults()}
    check_method_params(name, config)


def test_the_factory_gets_the_checked_settings_with_defaults():
    built = {}
    settings = PLDSettings.from_params({"name": "pld", "num_draft": 4})
    assert settings == PLDSettings(num_draft=4) and settings.max_ngram == PLDSettings().max_ngram
    decoder = get_method("pld")(None, {"name": "pld", "branches": 2})
    built.update(max_ngram=decoder.max_ngram, num_draft=decoder.describe()["num_draft"], branches=decoder.branches)
    assert built == {**PLDSettings().to_dict(), "branches": 2}
    assert decoder.sizing.value == 10 and decoder.sizing.cut(4) is None  # `auto` without a profile: upstream's
    with pytest.raises(ConfigError, match=r"^method.max_ngram=0: valid: an integer >= 1$"):
        get_method("pld")(None, {"name": "pld", "max_ngram": 0})
    with pytest.raises(ConfigError, match=r"^method.ngram=3: valid: one of the keys branches, max_ngram, num_draft$"):
        check_method_params("pld", {"name": "pld", "ngram": 3})


def test_a_methods_size_is_declared_by_its_settings_class():
    """The setting a sweep varies and the size a report reads come from the class (no list elsewhere)."""
    from harness.reporting.tables import settings_of

    assert method_settings("pld").size_setting == "num_draft" and method_settings("sps").size_setting == "gamma"
    assert method_settings("eagle2").size_in({"total_tokens": 8, "depth": 3}) == ("tree size (total tokens)", 8)
    assert method_settings("medusa").size_in({"tree_nodes": 8, "heads": 4}) == ("tree size (nodes)", 8)
    assert method_settings("mcsd").size_in({"k_config": [4, 2, 1]}) == ("draft tree nodes", 4 + 8 + 8)
    assert method_settings("ar").size_in({"gamma": 4}) is None  # a key of another method's is not AR's size
    assert settings_of("no-such-method").size_in({"gamma": 4}) is None
    for name in available_methods():  # every declared size is one of the method's own settings
        settings = method_settings(name)
        if settings.size_setting:
            assert settings.size_setting in {f.name for f in fields(settings)}, name
