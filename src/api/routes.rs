//! Every route of both HTTP listeners, one row each: which listener serves
//! it, its method and path, what it is, and who may call it.
//!
//! In: nothing (a table). Out: [`ROUTES`], and [`add`], the one way a
//! router registers a route. Guarantees: the routers register their routes
//! through [`add`] alone, so a route is served only where it has a row, on
//! the row's method and path; the API's description
//! ([`super::openapi`]) is made from the same rows, so it lists every route
//! the listeners serve and no other. `tests/openapi.rs` checks that no
//! router registers a route another way, and that every row is served.

use axum::Router;
use axum::handler::Handler;
use axum::routing::{MethodFilter, on};

use crate::auth::Scope;

/// The two listeners of `serve`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Listener {
    /// `server.listen`: the API and what every client may ask.
    Public,
    /// `server.admin_listen`: what the operator and the scraper ask.
    Admin,
}

impl Listener {
    pub const fn as_str(self) -> &'static str {
        match self {
            Listener::Public => "public",
            Listener::Admin => "admin",
        }
    }
}

/// The methods the listeners serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verb {
    Get,
    Post,
}

impl Verb {
    /// Lower case, as an OpenAPI path item names it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::Post => "post",
        }
    }

    /// Upper case, as a request line names it.
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))]
    pub const fn method(self) -> &'static str {
        match self {
            Verb::Get => "GET",
            Verb::Post => "POST",
        }
    }

    const fn filter(self) -> MethodFilter {
        match self {
            Verb::Get => MethodFilter::GET,
            Verb::Post => MethodFilter::POST,
        }
    }
}

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Anyone who can reach the listener.
    Open,
    /// An API key with this scope (`server.auth = "required"`, the
    /// default; with `"disabled"` the request names its tenant instead).
    Key(Scope),
    /// Anyone who can reach the listener, or, with `server.admin_auth =
    /// "key"`, an API key with the `admin` scope.
    AdminKey,
    /// An API key with `runs:read`, which sees its own tenant's runs, or
    /// one with `admin`, which sees every tenant's.
    Reader,
    /// An API key with `runs:write`, which acts on its own tenant's, or
    /// one with `admin`, on every tenant's.
    Writer,
    /// An API key with the `admin` scope, whatever `server.admin_auth`
    /// says: what acts on every tenant's runs is never open to whoever
    /// reaches the listener. (With `server.auth = "disabled"`, for local
    /// development only, no request takes a key.)
    Admin,
}

/// What a route does: one handler each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    Healthz,
    PublicReadyz,
    OpenApi,
    CreateRun,
    ListRuns,
    CountRuns,
    GetRun,
    RunHistory,
    OutboxStatus,
    RedriveOutbox,
    RetentionStatus,
    ListLetters,
    CountLetters,
    GetLetter,
    ReplayLetter,
    ReplayLetters,
    DiscardLetter,
    SignalRun,
    CancelRun,
    RetryRun,
    AdminHealthz,
    AdminReadyz,
    Metrics,
    AdminOpenApi,
    AdminListRuns,
    AdminCountRuns,
    AdminRunHistory,
    AdminCancelRun,
    AdminRetryRun,
    AdminListLetters,
    AdminCountLetters,
    AdminGetLetter,
    AdminReplayLetter,
    AdminReplayLetters,
    AdminDiscardLetter,
    AdminOutboxStatus,
    AdminRedriveOutbox,
    AdminRetentionStatus,
    Console,
    ConsoleScript,
    ConsoleStyle,
}

/// One route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub listener: Listener,
    pub verb: Verb,
    /// In axum's syntax, which is OpenAPI's: `/v1/runs/{run_id}`.
    pub path: &'static str,
    pub endpoint: Endpoint,
    pub access: Access,
}

const fn route(
    listener: Listener,
    verb: Verb,
    path: &'static str,
    endpoint: Endpoint,
    access: Access,
) -> Route {
    Route {
        listener,
        verb,
        path,
        endpoint,
        access,
    }
}

/// Every route of both listeners. The operator's views and actions are on
/// both: on the public one for a tenant's key (and an operator's), on the
/// admin one for an operator's key alone, beside the console that calls
/// them.
pub const ROUTES: [Route; 41] = {
    use Access::{Admin as Operator, AdminKey, Key, Open, Reader, Writer};
    use Listener::{Admin, Public};
    use Verb::{Get, Post};
    [
        route(Public, Get, "/healthz", Endpoint::Healthz, Open),
        route(Public, Get, "/readyz", Endpoint::PublicReadyz, Open),
        route(Public, Get, "/v1/openapi.json", Endpoint::OpenApi, Open),
        route(
            Public,
            Post,
            "/v1/runs",
            Endpoint::CreateRun,
            Key(Scope::RunsWrite),
        ),
        route(Public, Get, "/v1/runs", Endpoint::ListRuns, Reader),
        route(Public, Get, "/v1/runs/counts", Endpoint::CountRuns, Reader),
        route(
            Public,
            Get,
            "/v1/runs/{run_id}",
            Endpoint::GetRun,
            Key(Scope::RunsRead),
        ),
        route(
            Public,
            Get,
            "/v1/runs/{run_id}/history",
            Endpoint::RunHistory,
            Reader,
        ),
        route(
            Public,
            Post,
            "/v1/runs/{run_id}/signals",
            Endpoint::SignalRun,
            Key(Scope::RunsWrite),
        ),
        route(
            Public,
            Post,
            "/v1/runs/{run_id}/cancel",
            Endpoint::CancelRun,
            Key(Scope::RunsWrite),
        ),
        route(
            Public,
            Post,
            "/v1/runs/{run_id}/retry",
            Endpoint::RetryRun,
            Key(Scope::RunsWrite),
        ),
        route(
            Public,
            Get,
            "/v1/outbox",
            Endpoint::OutboxStatus,
            Key(Scope::Admin),
        ),
        route(
            Public,
            Post,
            "/v1/outbox/redrive",
            Endpoint::RedriveOutbox,
            Key(Scope::Admin),
        ),
        route(
            Public,
            Get,
            "/v1/retention",
            Endpoint::RetentionStatus,
            Key(Scope::Admin),
        ),
        route(
            Public,
            Get,
            "/v1/dead-letters",
            Endpoint::ListLetters,
            Reader,
        ),
        route(
            Public,
            Get,
            "/v1/dead-letters/counts",
            Endpoint::CountLetters,
            Reader,
        ),
        route(
            Public,
            Get,
            "/v1/dead-letters/{letter_id}",
            Endpoint::GetLetter,
            Reader,
        ),
        route(
            Public,
            Post,
            "/v1/dead-letters/{letter_id}/replay",
            Endpoint::ReplayLetter,
            Writer,
        ),
        route(
            Public,
            Post,
            "/v1/dead-letters/replay",
            Endpoint::ReplayLetters,
            Writer,
        ),
        route(
            Public,
            Post,
            "/v1/dead-letters/{letter_id}/discard",
            Endpoint::DiscardLetter,
            Writer,
        ),
        route(Admin, Get, "/healthz", Endpoint::AdminHealthz, Open),
        route(Admin, Get, "/readyz", Endpoint::AdminReadyz, AdminKey),
        route(Admin, Get, "/metrics", Endpoint::Metrics, AdminKey),
        route(Admin, Get, "/v1/openapi.json", Endpoint::AdminOpenApi, Open),
        route(Admin, Get, "/v1/runs", Endpoint::AdminListRuns, Operator),
        route(
            Admin,
            Get,
            "/v1/runs/counts",
            Endpoint::AdminCountRuns,
            Operator,
        ),
        route(
            Admin,
            Get,
            "/v1/runs/{run_id}/history",
            Endpoint::AdminRunHistory,
            Operator,
        ),
        route(
            Admin,
            Post,
            "/v1/runs/{run_id}/cancel",
            Endpoint::AdminCancelRun,
            Operator,
        ),
        route(
            Admin,
            Post,
            "/v1/runs/{run_id}/retry",
            Endpoint::AdminRetryRun,
            Operator,
        ),
        route(
            Admin,
            Get,
            "/v1/dead-letters",
            Endpoint::AdminListLetters,
            Operator,
        ),
        route(
            Admin,
            Get,
            "/v1/dead-letters/counts",
            Endpoint::AdminCountLetters,
            Operator,
        ),
        route(
            Admin,
            Get,
            "/v1/dead-letters/{letter_id}",
            Endpoint::AdminGetLetter,
            Operator,
        ),
        route(
            Admin,
            Post,
            "/v1/dead-letters/{letter_id}/replay",
            Endpoint::AdminReplayLetter,
            Operator,
        ),
        route(
            Admin,
            Post,
            "/v1/dead-letters/replay",
            Endpoint::AdminReplayLetters,
            Operator,
        ),
        route(
            Admin,
            Post,
            "/v1/dead-letters/{letter_id}/discard",
            Endpoint::AdminDiscardLetter,
            Operator,
        ),
        route(
            Admin,
            Get,
            "/v1/outbox",
            Endpoint::AdminOutboxStatus,
            Operator,
        ),
        route(
            Admin,
            Post,
            "/v1/outbox/redrive",
            Endpoint::AdminRedriveOutbox,
            Operator,
        ),
        route(
            Admin,
            Get,
            "/v1/retention",
            Endpoint::AdminRetentionStatus,
            Operator,
        ),
        route(Admin, Get, "/ui", Endpoint::Console, Open),
        route(Admin, Get, "/ui/console.js", Endpoint::ConsoleScript, Open),
        route(Admin, Get, "/ui/console.css", Endpoint::ConsoleStyle, Open),
    ]
};

/// The row of `endpoint`, if it has one.
pub fn of(endpoint: Endpoint) -> Option<&'static Route> {
    ROUTES.iter().find(|r| r.endpoint == endpoint)
}

/// `router` with `endpoint`'s route, on its row's method and path, served
/// by `handler`.
///
/// # Panics
///
/// When `endpoint` has no row: a route must not be served without being
/// described. Routers are built as `serve` starts, so every test that
/// starts one would fail first.
pub fn add<S, H, T>(router: Router<S>, endpoint: Endpoint, handler: H) -> Router<S>
where
    H: Handler<T, S>,
    T: 'static,
    S: Clone + Send + Sync + 'static,
{
    let Some(row) = of(endpoint) else {
        panic!("{endpoint:?} has no row in api::routes::ROUTES");
    };
    router.route(row.path, on(row.verb.filter(), handler))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_endpoint_has_one_row_and_no_two_rows_share_a_route() {
        for (i, row) in ROUTES.iter().enumerate() {
            assert_eq!(
                of(row.endpoint),
                Some(row),
                "{:?} has one row",
                row.endpoint
            );
            for other in &ROUTES[i + 1..] {
                assert!(
                    (row.listener, row.verb, row.path) != (other.listener, other.verb, other.path),
                    "{row:?} and {other:?}"
                );
            }
        }
        let endpoints: std::collections::HashSet<_> = ROUTES.iter().map(|r| r.endpoint).collect();
        assert_eq!(endpoints.len(), ROUTES.len());
    }
}
