#!/usr/bin/env bash
# Install the test broker, Apache Kafka, from Maven Central if it is not
# cached yet, and print its directory (the jars are in its `libs/`).
#
# The broker is `org.apache.kafka:kafka_2.13` with its runtime dependencies,
# plus log4j's SLF4J 1.7 binding (Kafka logs through slf4j-api 1.7): the jars
# of Kafka's release tarball that the broker needs. Maven fetches them once
# (about 45 MB) into the cache directory (default ~/.cache/kairos), where a
# fresh clone, CI and later runs find them. A JDK 17+ and Maven are installed
# from Debian's packages when missing.
#
# No Maven here but a Kafka cluster running? Skip this script and point the
# tests at it: KAIROS_TEST_BROKERS=host:9092 (see docs/testing.md).
set -euo pipefail

VERSION=4.1.1
CACHE="${KAIROS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kairos}"
ROOT="$CACHE/kafka-$VERSION"

if [ -f "$ROOT/complete" ]; then
  echo "$ROOT"
  exit 0
fi

fail() {
  echo "install-broker: $*" >&2
  echo "install-broker: without a JDK and Maven, run the tests against a running Kafka instead:" >&2
  echo "install-broker:   KAIROS_TEST_BROKERS=host:9092 ./scripts/test.sh" >&2
  exit 1
}

apt_install() { # install Debian packages, as root or through sudo
  command -v apt-get >/dev/null || return 1
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  "${sudo[@]}" apt-get update -qq >/dev/null &&
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "$@" >/dev/null
}

java_major() { # the major version of `java` on PATH, or 0
  java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1 | grep . || echo 0
}

if ! command -v java >/dev/null || [ "$(java_major)" -lt 17 ]; then
  echo "install-broker: installing a JDK (Debian default-jdk-headless)" >&2
  apt_install default-jdk-headless || fail "no Java 17+ and it could not be installed"
fi
[ "$(java_major)" -ge 17 ] || fail "Kafka $VERSION needs Java 17 or newer; java on PATH is $(java_major)"
if ! command -v mvn >/dev/null; then
  echo "install-broker: installing Maven (Debian maven)" >&2
  apt_install maven || fail "no Maven and it could not be installed"
fi

mkdir -p "$ROOT"
cat >"$ROOT/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>kairos.test</groupId>
  <artifactId>kafka-broker</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>$VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>2.24.3</version>
    </dependency>
  </dependencies>
</project>
EOF
echo "install-broker: fetching Apache Kafka $VERSION from Maven Central into $ROOT (once)" >&2
rm -rf "$ROOT/libs"
mvn -q -B -f "$ROOT/pom.xml" -Dmaven.repo.local="$CACHE/m2" \
  dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$ROOT/libs" >&2 ||
  fail "Maven could not fetch org.apache.kafka:kafka_2.13:$VERSION"
for jar in "kafka_2.13-$VERSION.jar" "kafka-clients-$VERSION.jar" log4j-core-*.jar log4j-slf4j-impl-*.jar; do
  compgen -G "$ROOT/libs/$jar" >/dev/null || fail "$jar is missing from $ROOT/libs"
done
echo "$VERSION" >"$ROOT/complete"
echo "$ROOT"
