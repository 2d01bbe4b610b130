-- A serve that runs under a name of its own, stable across its restarts
-- (`kafka.group_instance_id`, a pod's name), records it with its drainer.
-- When the process of that name starts again, its drainer gives back at
-- once the claims its earlier incarnations still hold: they died with
-- their process. Without a name, a killed drainer's claims are given back
-- after `drainer.member_timeout_ms` of silence, as before.
ALTER TABLE eec_drainer_member
    ADD COLUMN instance text CHECK (length(instance) BETWEEN 1 AND 256);
