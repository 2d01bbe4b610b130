//! The settings that carry credentials, each in a type that redacts itself.
//!
//! In: a database URL with its password, a signing key, librdkafka
//! properties that may hold SASL or TLS secrets. Out: the value itself only
//! through a call that says so ([`DatabaseUrl::expose`], the signing keys'
//! bytes through [`super::SignaturesConfig`]). Guarantees: `Debug` (and,
//! for a URL, `Display`) never shows a secret, so neither do logs nor
//! `ductor config`, which print the configuration that way: a URL's
//! password reads `[redacted]`, a signing key reads `[redacted]` whole, and
//! so does the value of every Kafka property whose key looks secret
//! ([`KafkaProperties::is_secret_key`]). What a Kafka property may not
//! change is checked beside the Kafka section (`kafka.rs`).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A Postgres URL whose password never reaches `Debug` or `Display`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DatabaseUrl(String);

impl DatabaseUrl {
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The URL with its password, for connecting. Never log this.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The role this URL logs in as, decoded (libpq's default when the URL
    /// names none); `None` for a URL that does not parse.
    pub fn user(&self) -> Option<String> {
        let options: sqlx::postgres::PgConnectOptions = self.0.parse().ok()?;
        Some(options.get_username().to_owned())
    }

    /// The URL with the password replaced, safe to log: the one after
    /// the user name, and a `password` query parameter (which sqlx
    /// accepts too).
    pub fn redacted(&self) -> String {
        let Ok(mut u) = url::Url::parse(&self.0) else {
            return "[unparseable url redacted]".to_string();
        };
        if u.password().is_some() {
            let _ = u.set_password(Some("[redacted]"));
        }
        if u.query_pairs().any(|(key, _)| key == "password") {
            let pairs: Vec<(String, String)> = u
                .query_pairs()
                .map(|(key, value)| {
                    let value = if key == "password" {
                        "[redacted]".into()
                    } else {
                        value.into_owned()
                    };
                    (key.into_owned(), value)
                })
                .collect();
            u.query_pairs_mut().clear().extend_pairs(pairs);
        }
        u.to_string()
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// A tenant's signing key: printed as `[redacted]`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SigningKey(pub String);

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"[redacted]\"")
    }
}

/// librdkafka properties passed through verbatim. `Debug` redacts values of
/// keys that carry credentials.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KafkaProperties(pub BTreeMap<String, String>);

impl KafkaProperties {
    /// Whether the value of `key` is a credential, redacted wherever the
    /// properties are printed.
    pub fn is_secret_key(key: &str) -> bool {
        let key = key.to_ascii_lowercase();
        [
            "password",
            "secret",
            "jaas",
            "token",
            "ssl.key.pem",
            "private",
        ]
        .iter()
        .any(|needle| key.contains(needle))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter()
    }
}

impl fmt::Debug for KafkaProperties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (k, v) in &self.0 {
            if Self::is_secret_key(k) {
                map.entry(k, &"[redacted]");
            } else {
                map.entry(k, v);
            }
        }
        map.finish()
    }
}
