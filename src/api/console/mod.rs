//! The web console: a page, its script and its style sheet, shipped inside
//! the binary and served on the admin listener at `/ui`.
//!
//! In: a request for one of the files. Out: the file, with a
//! Content-Security-Policy that lets the page run only this listener's own
//! script and style and talk only to this listener. Guarantees: the files
//! carry no data, so serving them takes no key; everything the pages show
//! they read from the operator's API on the same listener, with the key the
//! operator pastes (kept in the tab's `sessionStorage`, sent only in the
//! `Authorization` header, never in a URL or a cookie); nothing is fetched
//! from anywhere else, and nothing is built at run time or by a toolchain
//! other than Cargo's.
//!
//! The pages (runs, one run, dead letters, one letter, overview) are
//! entries of the script's `PAGES` table; the actions on a run are entries
//! of its `RUN_ACTIONS`, and a letter's are its Replay and Discard buttons,
//! each shown only when the API description this listener serves offers its
//! route.

use axum::Router;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::routes::{Endpoint, add};

/// The page: a shell the script fills.
const PAGE: &str = include_str!("index.html");
/// Every page's behaviour.
const SCRIPT: &str = include_str!("console.js");
/// Every page's look.
const STYLE: &str = include_str!("console.css");

/// What a console file may load and where it may connect: this listener's
/// script, style and API, and nothing else; no inline script or style, no
/// frame around it, no form posted anywhere.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// The console's routes.
pub fn router() -> Router {
    let router = add(Router::new(), Endpoint::Console, page);
    let router = add(router, Endpoint::ConsoleScript, script);
    add(router, Endpoint::ConsoleStyle, style)
}

async fn page() -> Response {
    file("text/html; charset=utf-8", PAGE)
}

async fn script() -> Response {
    file("text/javascript; charset=utf-8", SCRIPT)
}

async fn style() -> Response {
    file("text/css; charset=utf-8", STYLE)
}

/// A console file with the headers every one carries.
fn file(media: &'static str, body: &'static str) -> Response {
    let headers = [
        (header::CONTENT_TYPE, HeaderValue::from_static(media)),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
        // The files change with the binary: a browser asks again rather
        // than run a script of an older serve against a newer API.
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        (
            HeaderName::from_static("cross-origin-opener-policy"),
            HeaderValue::from_static("same-origin"),
        ),
    ];
    (StatusCode::OK, headers, body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_its_own_script_and_style() {
        assert!(PAGE.contains(r#"<script src="/ui/console.js" defer></script>"#));
        assert!(PAGE.contains(r#"<link rel="stylesheet" href="/ui/console.css">"#));
        for inline in ["<style", "style=", "onclick=", "onload=", "javascript:"] {
            assert!(!PAGE.contains(inline), "{inline} in the page");
        }
        for text in [PAGE, SCRIPT, STYLE] {
            assert!(!text.contains("http://") || text.contains("http://www.w3.org/2000/svg"));
            assert!(!text.contains("https://"), "a file names another origin");
        }
    }

    #[test]
    fn the_policy_allows_no_other_origin_and_nothing_inline() {
        for directive in CONTENT_SECURITY_POLICY.split(';') {
            let sources: Vec<&str> = directive.split_whitespace().skip(1).collect();
            assert!(
                sources.iter().all(|s| ["'self'", "'none'"].contains(s)),
                "{directive}"
            );
        }
    }

    #[test]
    fn the_key_is_kept_in_the_session_and_sent_in_a_header_only() {
        assert!(SCRIPT.contains("sessionStorage"));
        assert!(!SCRIPT.contains("localStorage"));
        assert!(!SCRIPT.contains("document.cookie"));
        assert!(SCRIPT.contains(r#"Authorization: "Bearer " + key()"#));
    }
}
