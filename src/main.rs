//! `idem`: parse the command line, run it, map the outcome to an exit code
//! (0 success, 1 failure with a one-line reason, 2 bad usage).

fn main() {
    let code = match idem::cli::run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem: {e}");
            match e {
                idem::Error::Usage(_) => 2,
                _ => 1,
            }
        }
    };
    std::process::exit(code);
}
