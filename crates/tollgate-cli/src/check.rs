//! `check`: a limits file read as the layer reads it, from a path or standard input.

use std::io::Read;
use std::path::Path;
use std::process::ExitCode;

use tollgate::{Limits, LimitsFile};

/// Prints the effective limits of `file` (`-`: standard input).
pub(crate) fn run(file: &Path) -> Result<(), ExitCode> {
    let (file, limits) = if file == Path::new("-") {
        let mut text = String::new();
        if let Err(e) = std::io::stdin().read_to_string(&mut text) {
            eprintln!("standard input: cannot read it: {e}");
            return Err(ExitCode::from(1));
        }
        let limits = LimitsFile::new()
            .any_principal()
            .parse(&text)
            .map_err(|e| {
                eprintln!("standard input: {e}");
                ExitCode::from(1)
            })?;
        (Path::new("standard input"), limits)
    } else {
        (file, load(file)?)
    };
    crate::table::print(file, &limits);
    Ok(())
}

/// The limits of the file at `file`, or exit 1 with why not.
pub(crate) fn load(file: &Path) -> Result<Limits, ExitCode> {
    LimitsFile::new().any_principal().read(file).map_err(|e| {
        eprintln!("{}: {e}", file.display());
        ExitCode::from(1)
    })
}
