//! Where one attempt at a batch runs: a transaction, or one statement that
//! is its own.
//!
//! In: the pool, and whether the batch can be written by one statement (it
//! has no routed requests). Out: a [`Session`] whose connection the load
//! and the write use, then its commit or its rollback. Guarantees: a batch
//! with routed requests commits the routing plane's reserve and complete
//! statements in the same transaction as its runs; a batch without them
//! commits with its one batch statement, and a failed one leaves nothing
//! behind.

use sqlx::{PgConnection, PgPool, Postgres, Transaction as PgTx};

/// Where one attempt at a batch runs. A batch with routed requests needs a
/// transaction: the routing plane's reserve and complete statements commit
/// with the batch. Any other batch is written by one statement, which is its
/// own transaction, so it saves the BEGIN and COMMIT round trips; its loads
/// read outside any transaction, which the optimistic lock makes safe (the
/// write only lands on the `record_version` that was read).
pub(super) enum Session {
    Transaction(PgTx<'static, Postgres>),
    Statement(sqlx::pool::PoolConnection<Postgres>),
}

impl Session {
    pub(super) async fn open(
        pool: &PgPool,
        single_statement: bool,
    ) -> Result<Session, sqlx::Error> {
        Ok(if single_statement {
            Session::Statement(pool.acquire().await?)
        } else {
            Session::Transaction(pool.begin().await?)
        })
    }

    pub(super) fn conn(&mut self) -> &mut PgConnection {
        match self {
            Session::Transaction(tx) => tx,
            Session::Statement(conn) => conn,
        }
    }

    /// Commits the transaction; the single statement has already committed.
    pub(super) async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Session::Transaction(tx) => tx.commit().await,
            Session::Statement(_) => Ok(()),
        }
    }

    /// Rolls the transaction back; a single statement that failed left
    /// nothing behind.
    pub(super) async fn rollback(self) -> Result<(), sqlx::Error> {
        match self {
            Session::Transaction(tx) => tx.rollback().await,
            Session::Statement(_) => Ok(()),
        }
    }
}
