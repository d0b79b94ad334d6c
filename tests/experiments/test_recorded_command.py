"""Result files record the command that made them, without this machine's paths."""

from experiments.common import recorded_command


def test_paths_inside_the_working_directory_are_recorded_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inside = tmp_path / "runs" / "out dir"
    outside = "/elsewhere/ckpt"
    command = recorded_command("experiments.run", [
        "--out", str(inside), f"--indexer-dir={inside}", "--init", outside,
        "--extra", "a:candidate_tokens=4096", "relative/path"])
    assert command == ("python -m experiments.run --out 'runs/out dir' "
                       "'--indexer-dir=runs/out dir' --init /elsewhere/ckpt "
                       "--extra a:candidate_tokens=4096 relative/path")
    assert str(tmp_path) not in command
