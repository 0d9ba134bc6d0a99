//! The integration tests, one binary (one link): they share one Apache
//! Kafka broker (`common::kafka`), each on topics and groups of its own, so
//! tests run in parallel; the crash suites (`tests/crash.rs`,
//! `tests/worker_processes.rs`) stay binaries of their own, run one after
//! the other.

#[path = "../common/mod.rs"]
mod common;

mod admin;
mod apply_lanes;
mod bad_input;
mod changelog_order;
mod compose;
mod contract;
mod dashboard;
mod demo;
mod dlq;
mod exactly_once;
mod fencing;
mod first_contact;
mod foreign_clients;
mod scheduler;
mod schedules;
mod security;
mod store_faults;
mod worker;
mod worker_exactly_once;
