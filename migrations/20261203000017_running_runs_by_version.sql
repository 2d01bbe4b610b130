-- The running runs, by workflow version. `serve` counts them at start to
-- find the versions they need that `coordinator.workflows_dir` no longer
-- defines, and pages through those of one such version to fail them
-- (`coordinator.fail_runs_of_missing_workflows`): both read this index
-- alone instead of the whole table. A run leaves it when it finishes
-- (`finished_at` is set exactly then), so it stays as small as the work
-- in flight; updates of a running run change none of its columns.
CREATE INDEX runs_running_version_idx
    ON runs (workflow_name, workflow_version, run_id)
    WHERE finished_at IS NULL;
