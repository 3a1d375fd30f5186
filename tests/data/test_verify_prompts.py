"""`regen verify`'s prompt check where it cannot or need not run: a run made before the manifest recorded a
template has none (it reads as before); a template that is not on this host, or not the run's, is one warning."""

from __future__ import annotations

from app.data.verify_prompts import prompt_check


def test_a_run_without_a_recorded_template_is_not_checked():
    assert prompt_check({"model": {"path": "/nowhere"}}) == (None, None)


def test_a_missing_model_folder_is_one_warning(tmp_path):
    check, skipped = prompt_check({"model": {"path": str(tmp_path / "gone")},
                                   "chat_template": {"sha256": "0" * 64, "kwargs": {"add_generation_prompt": True}}})
    assert check is None and skipped.kind == "prompt_check_skipped" and skipped.severity == "warning"
    assert str(tmp_path / "gone") in skipped.detail


def test_another_template_is_one_warning_naming_both_shas(tiny_model):
    check, skipped = prompt_check({"model": {"path": str(tiny_model)},
                                   "chat_template": {"sha256": "f" * 64, "kwargs": {"add_generation_prompt": True}}})
    assert check is None and skipped.kind == "prompt_check_skipped" and "f" * 64 in skipped.detail
