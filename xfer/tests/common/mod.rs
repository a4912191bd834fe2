//! What several test binaries share.
#![allow(dead_code)]

pub mod child;
pub mod kv;
pub mod layouts;
