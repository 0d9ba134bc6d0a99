// A Kairos client in Java, using only the documented wire contract and the
// official Kafka client (org.apache.kafka:kafka-clients). The part between
// the README markers is the Java example of docs/producers.md; the tests run this file.
//
//   java -cp 'KAFKA_LIBS/*' ScheduleJobs.java jobs BROKERS SCHEDULE_TOPIC WORK_TOPIC N KEYS DELAY_MS
//       Schedules N jobs over KEYS keys, due DELAY_MS from now (each key's
//       jobs 50 ms apart, in order), through the schedule topic. Prints one
//       line per job: "ID KEY SEQ RUN_AT_MS".
//
//   java -cp 'KAFKA_LIBS/*' ScheduleJobs.java keys BROKERS TOPIC KEY...
//       Writes one record per key to TOPIC, keyed, with the header
//       kairos-client=java, and prints "KEY PARTITION" for each.

import static java.nio.charset.StandardCharsets.UTF_8;

import java.time.Instant;
import java.util.Properties;
import java.util.UUID;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.common.serialization.StringSerializer;

public class ScheduleJobs {
    // README:begin
    static KafkaProducer<String, byte[]> producer(String brokers) {
        var props = new Properties();
        props.put("bootstrap.servers", brokers);
        props.put("enable.idempotence", "true");
        // Java's default partitioner hashes the key with murmur2, as Kairos's
        // producer does: a key's jobs land on the same partition.
        return new KafkaProducer<>(props, new StringSerializer(), new ByteArraySerializer());
    }

    /** Schedule a job through `scheduleTopic`: `payload` runs on `workTopic` at `runAt`. */
    static String schedule(KafkaProducer<String, byte[]> producer, String scheduleTopic, String workTopic,
                           String key, byte[] payload, Instant runAt) throws Exception {
        var id = UUID.randomUUID().toString();  // the job id: handlers deduplicate on it
        var record = new ProducerRecord<String, byte[]>(scheduleTopic, key, payload);
        record.headers()
            .add("kairos-id", id.getBytes(UTF_8))
            .add("kairos-run-at", runAt.toString().getBytes(UTF_8))  // RFC 3339, UTC
            .add("kairos-topic", workTopic.getBytes(UTF_8))
            .add("kairos-tenant", "java".getBytes(UTF_8));
        producer.send(record).get();  // acknowledged by the brokers
        return id;
    }
    // README:end

    public static void main(String[] args) throws Exception {
        String brokers = args[1];
        try (var producer = producer(brokers)) {
            switch (args[0]) {
                case "jobs" -> jobs(producer, args[2], args[3], Integer.parseInt(args[4]),
                        Integer.parseInt(args[5]), Long.parseLong(args[6]));
                case "keys" -> {
                    for (int i = 3; i < args.length; i++) {
                        var record = new ProducerRecord<String, byte[]>(args[2], args[i], new byte[] {'x'});
                        record.headers().add("kairos-client", "java".getBytes(UTF_8));
                        System.out.println(args[i] + " " + producer.send(record).get().partition());
                    }
                }
                default -> throw new IllegalArgumentException("unknown mode " + args[0]);
            }
        }
    }

    /** Jobs over `keys` keys, each key's 50 ms apart, the first due `delayMs` from now. */
    static void jobs(KafkaProducer<String, byte[]> producer, String scheduleTopic, String workTopic,
                     int n, int keys, long delayMs) throws Exception {
        long base = System.currentTimeMillis() + delayMs;
        for (int i = 0; i < n; i++) {
            String key = "java-" + (i % keys);
            int seq = i / keys;
            long runAt = base + seq * 50L;
            byte[] payload = ("from java " + i).getBytes(UTF_8);
            String id = schedule(producer, scheduleTopic, workTopic, key, payload, Instant.ofEpochMilli(runAt));
            System.out.println(id + " " + key + " " + seq + " " + runAt);
        }
    }
}
