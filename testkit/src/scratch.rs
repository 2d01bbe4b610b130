//! A harness's own corner of the stack: a database made for it and the
//! topics it creates, both removed when it is done, so that runs of the
//! tests, the bench and the chaos harness never see each other's data.
//!
//! In: the migrator's URL (`DATABASE_MIGRATE_URL`, `database.migrate_url`),
//! which may create databases, and the Kafka settings the topics were made
//! with. Out: a database named `<prefix><random>`, the URL of any role on
//! it, and the deletion of both. Guarantees: a name is never reused; the
//! database belongs to the migrator, so a role of Ductor's gets on it only
//! what `ductor migrate` grants.

use std::sync::Mutex;

use anyhow::Context;
use ductor::config::KafkaConfig;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// A fresh database on the stack's server.
#[derive(Debug)]
pub struct ScratchDatabase {
    pub name: String,
    migrate_url: String,
}

impl ScratchDatabase {
    /// Creates `<prefix><random>` as the migrator of `migrate_url`.
    pub async fn create(migrate_url: &str, prefix: &str) -> anyhow::Result<ScratchDatabase> {
        let name = format!("{prefix}{}", uuid::Uuid::new_v4().simple());
        let admin = migrator(migrate_url).await?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .with_context(|| format!("creating database {name}"))?;
        admin.close().await;
        Ok(ScratchDatabase {
            name,
            migrate_url: migrate_url.to_owned(),
        })
    }

    /// The URL of `role_url`'s role on this database.
    pub fn url_for(&self, role_url: &str) -> anyhow::Result<String> {
        on_database(role_url, &self.name)
    }

    /// Drops the database, closing whatever sessions are left on it.
    pub async fn drop(self) -> anyhow::Result<()> {
        let admin = migrator(&self.migrate_url).await?;
        let dropped = ductor::infra::db::drop_database(&admin, &self.name)
            .await
            .with_context(|| format!("dropping database {}", self.name));
        admin.close().await;
        dropped
    }
}

/// One connection of the migrator, on the database its URL names.
async fn migrator(migrate_url: &str) -> anyhow::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(1)
        .connect(migrate_url)
        .await
        .context("connecting to postgres as the migrator (DATABASE_MIGRATE_URL)")
}

/// `url` with its database replaced by `name`.
pub fn on_database(url: &str, name: &str) -> anyhow::Result<String> {
    let mut url = url::Url::parse(url).context("parsing a database url")?;
    url.set_path(&format!("/{name}"));
    Ok(url.to_string())
}

/// The topics a harness made, to delete at its end.
#[derive(Debug, Default)]
pub struct ScratchTopics(Mutex<Vec<String>>);

impl ScratchTopics {
    /// Adds `topics` to those [`ScratchTopics::delete`] deletes.
    pub fn own(&self, topics: impl IntoIterator<Item = String>) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(topics);
    }

    /// Deletes every topic owned so far, each once.
    pub async fn delete(&self, kafka: &KafkaConfig) -> anyhow::Result<()> {
        let mut topics = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        topics.sort();
        topics.dedup();
        if topics.is_empty() {
            return Ok(());
        }
        ductor::infra::kafka::delete_topics(kafka, &topics)
            .await
            .with_context(|| format!("deleting topics {topics:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_role_url_is_moved_to_the_scratch_database_and_keeps_the_rest() {
        let url = "postgres://ductor:secret@127.0.0.1:25432/ductor?sslmode=disable";
        assert_eq!(
            on_database(url, "ductor_test_abc").unwrap(),
            "postgres://ductor:secret@127.0.0.1:25432/ductor_test_abc?sslmode=disable"
        );
        assert!(on_database("not a url", "x").is_err());
    }
}
