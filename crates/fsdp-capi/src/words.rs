//! The words of a message that reaches C. Messages made inside an entry point already
//! name the header's items where the library knows both spellings
//! ([`fsdp::error::Term`], under [`fsdp::error::Api::C`]); this is the last pass over the
//! text, for the library's own function names that every caller shares
//! (`init_process_group`, `clip_grad_norm_`, ...): each becomes the header function that
//! reaches it, the library's dtype names become DLPack's (`f32` is `float32`, as
//! `fsdp_dlpack_tensor.dtype` is described in the header), and a repeat of the entry
//! point's name right after its own prefix is dropped
//! (`fsdp_init_process_group: invalid argument: fsdp_init_process_group: ...`).

/// Library function and dtype names and the words a C host knows them by, longest first
/// where one name contains another.
const C_NAMES: &[(&str, &str)] = &[
    ("init_process_group", "fsdp_init_process_group"),
    ("destroy_process_group", "fsdp_destroy_process_group"),
    ("all_gather_into_tensor", "fsdp_all_gather_into_tensor"),
    ("reduce_scatter_tensor", "fsdp_reduce_scatter_tensor"),
    ("clip_grad_norm_", "fsdp_model_clip_grad_norm"),
    ("full_state_dict", "fsdp_model_full_state_dict"),
    ("load_state_dict", "fsdp_checkpoint_load"),
    ("new_group", "fsdp_new_group"),
    // dtypes, as `fsdp::DType` prints them and as a C host knows them (DLPack, numpy)
    ("bf16", "bfloat16"),
    ("f16", "float16"),
    ("f32", "float32"),
    ("f64", "float64"),
    ("i32", "int32"),
    ("i64", "int64"),
];

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `msg` with every library function name of [`C_NAMES`] that stands as a word of its
/// own replaced by its header function.
fn c_names(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    let mut i = 0;
    'scan: while i < msg.len() {
        let before = msg[..i].chars().next_back();
        if before.is_none_or(|c| !is_word_char(c)) {
            for (rust, c) in C_NAMES {
                if let Some(rest) = msg[i..].strip_prefix(rust) {
                    if rest.chars().next().is_none_or(|c| !is_word_char(c)) {
                        out.push_str(c);
                        i += rust.len();
                        continue 'scan;
                    }
                }
            }
        }
        let ch = msg[i..].chars().next().unwrap_or(' ');
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

/// The message `fsdp_last_error` gives for entry point `call` failing with `msg`.
pub(crate) fn for_c(call: &str, msg: &str) -> String {
    let msg = c_names(msg);
    // `msg` may start with the error class ("invalid argument: "), then the entry point's
    // own name again.
    let own = format!("{call}: ");
    let body = match msg.strip_prefix(&own) {
        Some(rest) => rest.to_string(),
        None => match msg.split_once(": ") {
            Some((class, rest)) if rest.starts_with(&own) => {
                format!("{class}: {}", &rest[own.len()..])
            }
            _ => msg.clone(),
        },
    };
    format!("{call}: {body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_names_become_header_functions_and_repeats_go() {
        assert_eq!(
            for_c(
                "fsdp_init_process_group",
                "invalid argument: init_process_group: world_size must be at least 1"
            ),
            "fsdp_init_process_group: invalid argument: world_size must be at least 1"
        );
        assert_eq!(
            for_c("fsdp_model_new", "fsdp_model_new: out of memory"),
            "fsdp_model_new: out of memory"
        );
        // Whole words only, never inside a longer name or twice.
        assert_eq!(
            c_names("call fsdp_init_process_group or init_process_group_x; clip_grad_norm_(2)"),
            "call fsdp_init_process_group or init_process_group_x; fsdp_model_clip_grad_norm(2)"
        );
        assert_eq!(
            c_names("load_state_dict: missing key 'w'"),
            "fsdp_checkpoint_load: missing key 'w'"
        );
        assert_eq!(
            c_names("dtype mismatch in grad: expected f32, got bf16 (to_f32 and f16x stay)"),
            "dtype mismatch in grad: expected float32, got bfloat16 (to_f32 and f16x stay)"
        );
    }
}
