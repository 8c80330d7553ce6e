"""What every way in writes: the report, the model card, the hub push, the release set, the run lock and the run folder."""
