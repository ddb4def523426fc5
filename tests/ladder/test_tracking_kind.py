"""The project's MLflow experiments open in the UI's model-training view: they carry the
experiment-kind tag the UI reads."""

from __future__ import annotations

from ladder import tracking


def test_a_new_ladder_experiment_is_tagged_as_model_training(seeded_root):
    uri = tracking.default_tracking_uri(seeded_root)
    exp_id = tracking.experiment_id(uri, "kind-new")
    tags = tracking.client(uri).get_experiment(exp_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"


def test_an_untagged_experiment_made_earlier_gets_the_tag_when_used_again(seeded_root):
    uri = tracking.default_tracking_uri(seeded_root)
    c = tracking.client(uri)
    exp_id = c.create_experiment("kind-old")
    assert "mlflow.experimentKind" not in c.get_experiment(exp_id).tags
    assert tracking.experiment_id(uri, "kind-old") == exp_id
    assert c.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"
