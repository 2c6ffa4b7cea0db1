//! The SQL stores' shared text: the `sql_store_common!` macro, stamped out by each store's file.

/// The parts of a SQL store that are the same text for every database: the statement
/// counter and accessors, the claim-shaped write, the fenced `complete`, and the `Store` impl
/// around each store's own `claim_on` (MySQL takes the `@common` part only). (One macro rather than a generic over
/// `sqlx::Database`, whose executor bounds would drown the statements.) Self-contained: the
/// expansion names everything by path inside its own `const _` block, so a call site imports
/// nothing for it.
macro_rules! sql_store_common {
    ($store:ident, $pool:ty, $db:ty, $conn:ty) => {
        sql_store_common!(@returning $store, $db, $conn);
        sql_store_common!(@common $store, $pool, $db, $conn);
    };
    // What a database whose statements can return rows they wrote (`RETURNING`: PostgreSQL,
    // SQLite) shares: the claim-shaped write, the complete's parameters, the heartbeat, the
    // sweeper's batch and the delete. MySQL, without `RETURNING`, writes its own
    // (`sql/mysql.rs`).
    (@returning $store:ident, $db:ty, $conn:ty) => {
        const _: () = {
            use std::sync::Arc;
            use std::time::{Duration, SystemTime};
            use $crate::store::fence::LeaseToken;
            use $crate::store::record::{RecordKey, RecordState, StoredOutcome};
            use $crate::store::sql::{
                build_record, db_error, from_millis, millis, outcome_columns, q, record_columns,
            };
            use $crate::store::{ClaimRequest, Deleted, StoreError};

            impl $store {
                /// Runs a claim-shaped statement (the SQLite insert, either store's take-over):
                /// binds scope, key, fingerprint, the new token, the lease and the initial expiry
                /// (lease + ttl), then the old token when taking over; returns the new lease end
                /// if a row was written.
                async fn claim_write(
                    &self,
                    conn: &mut $conn,
                    sql: &Arc<str>,
                    req: &ClaimRequest<'_>,
                    token: LeaseToken,
                    old: Option<LeaseToken>,
                ) -> Result<Option<i64>, StoreError> {
                    self.sent.bump();
                    let fingerprint = req.fingerprint.to_stored();
                    let mut query = sqlx::query_scalar(q(sql))
                        .bind(req.key.scope.as_str())
                        .bind(req.key.key.as_str())
                        .bind(&fingerprint[..])
                        .bind(token.as_uuid())
                        .bind(millis(req.lease))
                        .bind(millis(req.lease.saturating_add(req.ttl)));
                    if let Some(old) = old {
                        query = query.bind(old.as_uuid());
                    }
                    query.fetch_optional(&mut *conn).await.map_err(db_error)
                }

                /// The complete statement with its parameters bound: scope, key, token, the
                /// outcome's columns and the ttl.
                pub(crate) fn complete_query<'q>(
                    &self,
                    sql: &Arc<str>,
                    key: &'q RecordKey,
                    token: LeaseToken,
                    outcome: &StoredOutcome,
                    ttl: Duration,
                ) -> sqlx::query::Query<'q, $db, <$db as sqlx::Database>::Arguments> {
                    let c = outcome_columns(outcome);
                    self.sent.bump();
                    sqlx::query(q(sql))
                        .bind(key.scope.as_str())
                        .bind(key.key.as_str())
                        .bind(token.as_uuid())
                        .bind(c.status)
                        .bind(c.headers)
                        .bind(c.body)
                        .bind(c.oversized)
                        .bind(millis(ttl))
                }

                /// The fenced heartbeat: the new lease end, or `StaleLease`.
                async fn extend_once(
                    &self,
                    key: &RecordKey,
                    token: LeaseToken,
                    lease: Duration,
                ) -> Result<SystemTime, StoreError> {
                    let mut conflicts = 0;
                    loop {
                        self.sent.bump();
                        // On a pooled connection, or a fresh one after a write was abandoned
                        // (`FencedConns`).
                        let until: Result<Option<i64>, _> = self
                            .fenced
                            .run(&self.pool, async |conn| {
                                sqlx::query_scalar(q(&self.sql.extend))
                                    .bind(key.scope.as_str())
                                    .bind(key.key.as_str())
                                    .bind(token.as_uuid())
                                    .bind(millis(lease))
                                    .fetch_optional(&mut *conn)
                                    .await
                                    .map_err(db_error)
                            })
                            .await;
                        match until {
                            Err(e)
                                if $crate::store::sql::again_after_conflict(&e, &mut conflicts)
                                    .await => {}
                            until => return until?.map(from_millis).ok_or(StoreError::StaleLease),
                        }
                    }
                }

                /// One bounded batch of the sweeper (the `purge` statement).
                async fn purge_batch(&self, batch: usize) -> Result<u64, StoreError> {
                    self.sent.bump();
                    let done = sqlx::query(q(&self.sql.purge))
                        .bind(i64::try_from(batch).unwrap_or(i64::MAX))
                        .execute(&self.pool)
                        .await
                        .map_err(db_error)?;
                    Ok(done.rows_affected())
                }

                /// [`Store::delete`](crate::Store::delete): the `DELETE … RETURNING`, and a
                /// read that explains why nothing was deleted.
                async fn delete_record(
                    &self,
                    key: &RecordKey,
                    force: bool,
                ) -> Result<Deleted, StoreError> {
                    // A record that finishes between the DELETE and the read that explains why
                    // nothing was deleted is deleted on the next round.
                    let mut absent_once = false;
                    for _ in 0..3 {
                        self.sent.bump();
                        let row = sqlx::query(q(&self.sql.delete))
                            .bind(key.scope.as_str())
                            .bind(key.key.as_str())
                            .bind(force)
                            .fetch_optional(&self.pool)
                            .await
                            .map_err(db_error)?;
                        if let Some(row) = row {
                            let columns = record_columns(&row).map_err(db_error)?;
                            return Ok(Deleted::Deleted(build_record(key, columns)?));
                        }
                        // Nothing deleted: an in-progress record (without `force`), or none.
                        match $crate::store::Store::get(self, key).await? {
                            // Absent, or an in-progress row that expired since the DELETE:
                            // one more DELETE removes that one.
                            None if absent_once => return Ok(Deleted::Absent),
                            None => absent_once = true,
                            Some(record)
                                if matches!(record.state, RecordState::InProgress { .. }) =>
                            {
                                return Ok(Deleted::InProgress(record));
                            }
                            Some(_) => {}
                        }
                    }
                    Err(StoreError::Unavailable(
                        "the record kept changing while it was being deleted; try again".into(),
                    ))
                }
            }
        };
    };
    // The rest: accessors, the fenced complete on a connection, and the `Store` impl around
    // the store's own `claim_on`, `complete_query`, `extend_once`, `purge_batch` and
    // `delete_record`.
    (@common $store:ident, $pool:ty, $db:ty, $conn:ty) => {
        const _: () = {
            use std::time::{Duration, SystemTime};
            use $crate::store::fence::LeaseToken;
            use $crate::store::record::{Record, RecordKey, StoredOutcome};
            use $crate::store::sql::{build_record, db_error, existing_row, q, record_columns};
            use $crate::store::{ClaimOutcome, ClaimRequest, Deleted, Store, StoreError};

            impl $store {
                /// The pool.
                pub fn pool(&self) -> &$pool {
                    &self.pool
                }

                /// The table name (schema-qualified for PostgreSQL).
                pub fn table(&self) -> &str {
                    &self.sql.table
                }

                /// Statements this store (and its clones) has sent so far.
                pub fn statements_sent(&self) -> u64 {
                    self.sent.get()
                }

                /// Decodes the row a claim read and decides what to do about it.
                pub(crate) fn decide_row(
                    row: &<$db as sqlx::Database>::Row,
                    req: &ClaimRequest<'_>,
                ) -> Result<$crate::store::sql::Decision, StoreError> {
                    $crate::store::sql::decide(
                        existing_row(row).map_err(db_error)?,
                        req.fingerprint,
                    )
                }

                /// [`Store::complete`] on a connection or transaction you provide.
                ///
                /// # Errors
                /// As [`Store::complete`].
                pub async fn complete_on(
                    &self,
                    conn: &mut $conn,
                    key: &RecordKey,
                    token: LeaseToken,
                    outcome: &StoredOutcome,
                    ttl: Duration,
                ) -> Result<(), StoreError> {
                    // Inside the caller's transaction a serialization failure has aborted
                    // it: the error is theirs to see, not ours to run again.
                    let mut conflicts = if sqlx::Connection::is_in_transaction(&*conn) {
                        u32::MAX
                    } else {
                        0
                    };
                    let sql = self.complete_sql().await;
                    loop {
                        let done = self
                            .complete_query(&sql, key, token, outcome, ttl)
                            .execute(&mut *conn)
                            .await
                            .map_err(db_error);
                        match done {
                            Err(e)
                                if $crate::store::sql::again_after_conflict(&e, &mut conflicts)
                                    .await => {}
                            done => return $crate::store::sql::fenced(done?.rows_affected()),
                        }
                    }
                }

                async fn conn(&self) -> Result<sqlx::pool::PoolConnection<$db>, StoreError> {
                    self.pool.acquire().await.map_err(db_error)
                }
            }

            #[async_trait::async_trait]
            impl Store for $store {
                async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
                    let mut conn = self.conn().await?;
                    self.claim_on(&mut conn, req).await
                }

                async fn claim_with_expiry(
                    &self,
                    req: ClaimRequest<'_>,
                ) -> Result<(ClaimOutcome, Option<Duration>), StoreError> {
                    let mut conn = self.conn().await?;
                    self.claim_reported(&mut conn, req).await
                }

                async fn complete(
                    &self,
                    key: &RecordKey,
                    token: LeaseToken,
                    outcome: &StoredOutcome,
                    ttl: Duration,
                ) -> Result<(), StoreError> {
                    // On a pooled connection, or a fresh one after a write was abandoned
                    // (`FencedConns`).
                    self.fenced
                        .run(&self.pool, async |conn| {
                            self.complete_on(conn, key, token, outcome, ttl).await
                        })
                        .await
                }

                async fn release(
                    &self,
                    key: &RecordKey,
                    token: LeaseToken,
                ) -> Result<(), StoreError> {
                    let mut conflicts = 0;
                    let sql = self.release_sql().await;
                    loop {
                        self.sent.bump();
                        let done = self
                            .fenced
                            .run(&self.pool, async |conn| {
                                sqlx::query(q(&sql))
                                    .bind(key.scope.as_str())
                                    .bind(key.key.as_str())
                                    .bind(token.as_uuid())
                                    .execute(&mut *conn)
                                    .await
                                    .map_err(db_error)
                            })
                            .await;
                        match done {
                            Err(e)
                                if $crate::store::sql::again_after_conflict(&e, &mut conflicts)
                                    .await => {}
                            done => return $crate::store::sql::fenced(done?.rows_affected()),
                        }
                    }
                }

                async fn extend(
                    &self,
                    key: &RecordKey,
                    token: LeaseToken,
                    lease: Duration,
                ) -> Result<SystemTime, StoreError> {
                    self.extend_once(key, token, lease).await
                }

                async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
                    self.purge_batch(batch).await
                }

                async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
                    self.sent.bump();
                    let row = sqlx::query(q(&self.sql.get))
                        .bind(key.scope.as_str())
                        .bind(key.key.as_str())
                        .fetch_optional(&self.pool)
                        .await
                        .map_err(db_error)?;
                    row.map(|row| build_record(key, record_columns(&row).map_err(db_error)?))
                        .transpose()
                }

                async fn delete(
                    &self,
                    key: &RecordKey,
                    force: bool,
                ) -> Result<Deleted, StoreError> {
                    self.delete_record(key, force).await
                }

                fn transactional(&self) -> Option<&dyn std::any::Any> {
                    Some(self)
                }

                fn changes(&self) -> Option<&crate::store::Changes> {
                    Some(&self.changes)
                }
            }
        };
    };
}
