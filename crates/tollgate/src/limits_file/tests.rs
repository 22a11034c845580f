//! Where the loader says each mistake is.

use std::time::Duration;

use super::*;

fn error(text: &str) -> LimitsFileError {
    match LimitsFile::new().any_principal().parse(text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e,
    }
}

#[test]
fn a_mistake_is_reported_at_its_own_line() {
    let text = "[[limit]]\nname = \"a\"\nalgorithm = \"fixed_windw\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\n";
    let e = error(text);
    assert_eq!((e.line(), e.column()), (3, 13), "{e}");
    assert_eq!(
        e.message(),
        "limit \"a\": unknown algorithm \"fixed_windw\" (gcra, fixed_window, sliding_log, \
         concurrency)"
    );
    // One line per field: each mistake where it is, not at `[[limit]]` (line 1).
    let fields = [
        ("name = \"a b\"", 2, 8),
        ("period = \"1 minute\"", 4, 10),
        ("key = \"cookie\"", 5, 7),
        ("cost = 0", 7, 8),
        ("failure = \"sometimes\"", 8, 11),
        ("failure = { fallback = 0 }", 8, 11),
        ("missing_key = \"ignore\"", 9, 15),
    ];
    for (field, line, column) in fields {
        let mut lines = vec![
            "[[limit]]",
            "name = \"a\"",
            "algorithm = \"gcra\"",
            "period = \"1m\"",
            "key = \"ip\"",
            "quota = 5",
            "cost = 1",
            "failure = \"open\"",
            "missing_key = \"skip\"",
        ];
        lines[line - 1] = field;
        let e = error(&lines.join("\n"));
        assert_eq!((e.line(), e.column()), (line, column), "{field}: {e}");
    }
}

#[test]
fn a_quota_mistake_is_at_its_plan() {
    let text = "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"ip\"\n\n[limit.quota]\ndefault = 5\npro = 0\n";
    let e = error(text);
    assert_eq!((e.line(), e.column()), (8, 7), "{e}");
    assert_eq!(
        e.message(),
        "limit \"a\": a quota must admit at least one request"
    );
    let text = "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 0\n";
    let e = error(text);
    assert_eq!((e.line(), e.column()), (5, 9), "{e}");
    let text = "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"ip\"\n\n[limit.quota]\npro = 5\n";
    let e = error(text);
    assert_eq!((e.line(), e.column()), (6, 1), "{e}");
}

#[test]
fn a_bare_number_is_the_default_quota() {
    let text = "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\n";
    let limits = LimitsFile::new().parse(text).unwrap();
    let (limit, _) = limits.get("a").unwrap();
    assert_eq!(limit.quota().limit(), 5);
    assert_eq!(limit.quota().period(), Duration::from_secs(60));
    assert_eq!(limit.plans().len(), 0);
    // Not a quota: a sign, a string, more than u32.
    for (value, column) in [("-5", 9), ("\"5\"", 9), ("4294967296", 9)] {
        let e = error(&text.replace("quota = 5", &format!("quota = {value}")));
        assert_eq!((e.line(), e.column()), (5, column), "{value}: {e}");
        assert!(e.message().contains("a quota: a number"), "{value}: {e}");
    }
}

#[test]
fn a_name_given_twice_is_at_the_second_name() {
    let one = "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\n";
    let e = error(&format!("{one}{one}"));
    assert_eq!((e.line(), e.column()), (7, 8), "{e}");
    assert_eq!(
        e.message(),
        "two limits are named \"a\" (the first at line 2)"
    );
}

#[test]
fn an_allowlist_mistake_is_at_its_value() {
    let limit = "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\n\n";
    let text = format!(
        "{limit}[[allowlist]]\nkey = \"ip\"\nnetworks = [\"10.0.0.0/8\",\n  \"10.0.0.0/33\"]\n"
    );
    let e = error(&text);
    assert_eq!((e.line(), e.column()), (10, 3), "{e}");
    let text = format!(
        "{limit}[[allowlist]]\nkey = {{ header = \"x-shop\" }}\nvalues = [\"a.example\", \"bad shop!\"]\n"
    );
    let e = error(&text);
    assert_eq!((e.line(), e.column()), (9, 24), "{e}");
    let text = format!("{limit}[[allowlist]]\nkey = \"global\"\nnetworks = [\"10.0.0.0/8\"]\n");
    let e = error(&text);
    assert_eq!((e.line(), e.column()), (8, 7), "{e}");
}

#[test]
fn columns_count_characters() {
    let text = "[[limit]]\nname = \"a\" # é\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\n# é\u{e9}\nshadow = 1\n";
    let e = error(text);
    assert_eq!((e.line(), e.column()), (7, 10), "{e}");
    assert_eq!(LimitsFileError::position("é\u{e9}x", 4), (1, 3));
}
