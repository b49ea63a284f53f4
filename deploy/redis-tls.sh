#!/usr/bin/env bash
# Files for Redis over TLS with ACL users (deploy/redis-tls.conf), made with openssl.
#
#   deploy/redis-tls.sh certs DIR [HOST...]   DIR/ca.pem + ca.key (keep the key offline),
#                                              DIR/redis.pem + redis.key for HOST... (default
#                                              localhost 127.0.0.1), DIR/client.pem + client.key
#   deploy/redis-tls.sh acl DIR                DIR/users.acl from deploy/redis-users.acl.template
#                                              with new random passwords, kept in
#                                              DIR/chatstore.password and DIR/admin.password
#
# Every file is mode 0600. Certificates last CERT_DAYS (default 365) days; re-run `certs` with
# the same DIR to renew Redis's and the client's (the CA is kept when DIR/ca.key exists).
# tests/support/redis_tls.py makes the same set with the `cryptography` package for the tests.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CMD="${1:-}"; DIR="${2:-}"
[[ -n "$CMD" && -n "$DIR" ]] || { sed -n '2,13p' "$0"; exit 2; }
shift 2
DAYS="${CERT_DAYS:-365}"
umask 077
mkdir -p "$DIR"

leaf() {  # leaf NAME SUBJECT EXTENSIONS
    local name="$1" subject="$2" ext="$3"
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
        -keyout "$DIR/$name.key" -subj "$subject" -out "$DIR/$name.csr" 2>/dev/null
    openssl x509 -req -in "$DIR/$name.csr" -CA "$DIR/ca.pem" -CAkey "$DIR/ca.key" \
        -CAcreateserial -days "$DAYS" -sha256 -extfile <(printf '%s\n' "$ext") \
        -out "$DIR/$name.pem" 2>/dev/null
    rm -f "$DIR/$name.csr"
}

case "$CMD" in
    certs)
        hosts=("$@"); [[ ${#hosts[@]} -gt 0 ]] || hosts=(localhost 127.0.0.1)
        san=""
        for h in "${hosts[@]}"; do
            if [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then san+="IP:$h,"; else san+="DNS:$h,"; fi
        done
        if [[ ! -f "$DIR/ca.key" ]]; then
            openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
                -keyout "$DIR/ca.key" -subj "/CN=chatstore Redis CA" -days $((DAYS * 5)) \
                -addext "basicConstraints=critical,CA:TRUE" \
                -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$DIR/ca.pem" 2>/dev/null
        fi
        leaf redis "/CN=${hosts[0]}" "$(printf 'basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName=%s' "${san%,}")"
        leaf client "/CN=chatstore" "$(printf 'basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth')"
        chmod 600 "$DIR"/*.pem "$DIR"/*.key
        openssl verify -CAfile "$DIR/ca.pem" "$DIR/redis.pem" "$DIR/client.pem"
        echo "redis-tls.sh: certificates in $DIR (Redis's for ${hosts[*]})"
        ;;
    acl)
        acl="$(cat "$ROOT/deploy/redis-users.acl.template")"
        for user in chatstore admin; do
            password="$(openssl rand -hex 32)"
            printf '%s' "$password" >"$DIR/$user.password"
            digest="$(printf '%s' "$password" | sha256sum | cut -d' ' -f1)"
            acl="${acl//<sha256 of $user\'s password>/$digest}"
        done
        printf '%s\n' "$acl" >"$DIR/users.acl"
        echo "redis-tls.sh: $DIR/users.acl; passwords in $DIR/chatstore.password, admin.password"
        ;;
    *) echo "redis-tls.sh: unknown command $CMD (certs | acl)" >&2; exit 2 ;;
esac
