//! Kafka clients for looking at Ductor's topics from outside, built on
//! Ductor's own client settings ([`ductor::infra::kafka`]), so that what a
//! deployment needs to reach its broker (SASL, TLS, `kafka.properties` and
//! `kafka.consumer_properties`) reaches the harnesses' readers too.
//!
//! In: the deployment's [`KafkaConfig`], a group and a role for the client
//! id. Out: a client configuration the caller creates. Guarantees: a reader
//! starts at the beginning of a partition it has no offset for, sees only
//! committed messages, and commits nothing unless its caller says so.

use ductor::config::KafkaConfig;
use rdkafka::ClientConfig;

/// A reader in `group`: from the earliest offset, `read_committed`, no
/// automatic commits and no stored offsets.
pub fn reader_config(kafka: &KafkaConfig, group: &str, role: &str) -> ClientConfig {
    let mut cfg = ductor::infra::kafka::offsets_reader_config(kafka, group, role);
    cfg.set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false")
        .set("isolation.level", "read_committed");
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_keeps_the_deployments_consumer_properties() {
        let mut kafka = ductor::config::Config::load_from(None, Vec::new())
            .expect("the default configuration is valid")
            .kafka;
        kafka
            .consumer_properties
            .0
            .insert("sasl.mechanism".into(), "SCRAM-SHA-512".into());
        let cfg = reader_config(&kafka, "g", "checker");
        assert_eq!(cfg.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(cfg.get("group.id"), Some("g"));
        assert_eq!(cfg.get("enable.auto.commit"), Some("false"));
        assert_eq!(cfg.get("isolation.level"), Some("read_committed"));
    }
}
