//! `gateway --config <file.yaml> [--workers N] [--log-level info]`

use clap::Parser;

fn main() {
    let args = gateway::Args::parse();
    if let Err(e) = gateway::run(args) {
        eprintln!("gateway: error: {e:#}");
        std::process::exit(1);
    }
}
