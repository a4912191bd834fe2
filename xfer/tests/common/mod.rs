//! What several test binaries share.
#![allow(dead_code)]

pub mod kv;
pub mod layouts;
