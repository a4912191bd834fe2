//! The transfer engine (see mod docs).
