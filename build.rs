//! The migrations are compiled into the binary (`sqlx::migrate!`); a new
//! or changed file under `migrations/` must rebuild it.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
